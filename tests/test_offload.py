"""Offloading the training state (runtime/offload.py) between two actor train steps at DP=2 with the distributed
optimizer: while offloaded, parameters, gradient buffers and Adam's moments hold no memory; after two offloads (the
second into the first's host buffers), and after one in the colocation order's two parts (optimizer state while the
weights stay and serve a forward, then the weights), the second step gives exactly the weights of two steps without
offloading."""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf_mc.config import ParallelConfig
from rlhf_mc.runtime.spawn import spawn
from tests.test_train_step import LOSS, MODEL, OPTIM, STARTS, _data


def _two_steps(ckpt: str, offload_between: bool) -> dict:
    from megatron.core import parallel_state as ps

    from rlhf_mc.models.checkpoint import load_model, save_model
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.optim import setup_training
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.runtime.offload import offload_training_state, reload
    from rlhf_mc.data.trajectory import Trajectories
    from rlhf_mc.workers.train import train_step

    init_parallel(ParallelConfig(), seed=11)
    chunks = build_model(MODEL, ParallelConfig())
    (load_model if offload_between else save_model)(chunks, Path(ckpt) / "weights0")
    state = setup_training(chunks, OPTIM)
    seqs, per_token = _data()
    mine = list(range(ps.get_data_parallel_rank(), len(seqs), ps.get_data_parallel_world_size()))
    out: dict = {}
    for step in range(2):
        out[f"grad_norm{step}"] = train_step(state, Trajectories.single_turn(
            [seqs[i] for i in mine], [STARTS[i] for i in mine],
            {k: [v[i] for i in mine] for k, v in per_token.items()}),
            LOSS, temperature=0.9, micro_batch_tokens=40)["grad_norm"]
        if offload_between and step == 0:
            # Enumerated here, independently of training_tensors: what must be freed.
            inner = getattr(state.optimizer, "chained_optimizers", [state.optimizer])
            moments = [v for o in inner for s in o.optimizer.state.values() for v in s.values() if v.numel() > 1]
            expected = [*moments, *(t for p in chunks[0].parameters() for t in (p, p.main_grad))]
            out["moments"] = len(moments)
            out["bytes_before"] = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                       for t in expected}.values())
            saved = offload_training_state(chunks, state.optimizer, "all")
            out["bytes_offloaded"] = sum(t.untyped_storage().nbytes() for t in expected)
            reload(saved)
            again = offload_training_state(chunks, state.optimizer, "all", reuse=saved)  # as every later step does
            out["host_buffers_reused"] = all(a[2] is b[2] for a, b in zip(saved, again)) and len(saved) == len(again)
            reload(again)
            # The colocation order: optimizer state and gradients first, the weights still there for the sync ...
            params = list(chunks[0].parameters())
            first = offload_training_state(chunks, state.optimizer, "optimizer")
            out["optimizer_part_bytes"] = sum(t.untyped_storage().nbytes() for t in moments + [p.main_grad
                                                                                              for p in params])
            out["weights_kept_bytes"] = sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                                             for p in params}.values())
            out["logits_while_state_offloaded"] = chunks[0](seqs[0][None], torch.arange(len(seqs[0]))[None],
                                                                   None).detach()
            second = offload_training_state(chunks, state.optimizer, "weights")  # ... then the weights
            out["weights_part_bytes"] = sum(p.untyped_storage().nbytes() for p in params)
            reload(first)
            reload(second)
    out["weights"] = [p.detach().clone() for p in chunks[0].parameters()]
    return out


def test_offload_frees_the_training_state_and_the_next_step_is_unchanged(tmp_path):
    plain = spawn(_two_steps, 2, str(tmp_path), False)
    offloaded = spawn(_two_steps, 2, str(tmp_path), True)
    for a, b in zip(plain, offloaded):
        assert b["moments"] > 0, "no Adam state yet: the test would not cover it"
        param_bytes = sum(w.numel() * w.element_size() for w in b["weights"])
        assert b["bytes_before"] > 2 * param_bytes and b["bytes_offloaded"] == 0
        assert b["host_buffers_reused"]
        assert b["optimizer_part_bytes"] == 0 and b["weights_kept_bytes"] >= param_bytes
        assert b["weights_part_bytes"] == 0 and torch.isfinite(b["logits_while_state_offloaded"]).all()
        assert a["grad_norm1"] == b["grad_norm1"]
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))
