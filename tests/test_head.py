"""The vocabulary projection at chosen positions (models/head.py) against the full projection then the same rows:
Megatron's output layer at TP=1, at TP=2, and at TP=2 with sequence parallelism (each rank holding a slice of the
positions; the chosen rows gathered, padded to a multiple of tp and split again), logits and the gradients of the
hidden states and of the weight. And the log-prob pass: it projects the positions of response tokens only."""

from __future__ import annotations

import pytest
import torch

from rlhf_mc.runtime.spawn import spawn

SEQ, HIDDEN, VOCAB = 10, 8, 6


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(SEQ, 1, HIDDEN, generator=g), torch.randn(VOCAB, HIDDEN, generator=g),
            torch.randn(SEQ, 1, VOCAB, generator=g))


def _reference(positions: list[int]):
    hidden, weight, upstream = _inputs()
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    logits = hidden[positions] @ weight.T
    (logits * upstream[:len(positions)]).sum().backward()
    return logits.detach(), hidden.grad, weight.grad


def _at_positions(tp: int, sequence_parallel: bool, positions: list[int]):
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from rlhf_mc.config import ParallelConfig
    from rlhf_mc.models import head
    from rlhf_mc.runtime import init_parallel

    init_parallel(ParallelConfig(tp=tp))
    rank = ps.get_tensor_model_parallel_rank()
    config = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                                 use_cpu_initialization=True, params_dtype=torch.float32)
    model = torch.nn.Module()
    model.output_layer = ColumnParallelLinear(HIDDEN, VOCAB, config=config, init_method=torch.nn.init.zeros_,
                                              bias=False, gather_output=False)
    head.select_positions(model.output_layer)
    hidden, weight, upstream = _inputs()
    with torch.no_grad():
        model.output_layer.weight.copy_(weight.chunk(tp)[rank])
    mine = (hidden.chunk(tp)[rank] if sequence_parallel else hidden).clone().requires_grad_(True)
    with head.at_positions(model, torch.tensor(positions, dtype=torch.long)):
        logits, _ = model.output_layer(mine)
    projected = logits.shape[0]
    logits = logits[:len(positions)]  # the padding rows (sequence parallelism) dropped
    (logits * upstream[:len(positions)].chunk(tp, dim=-1)[rank]).sum().backward()
    assert model.output_layer.head_positions is None  # only within the block
    plain, _ = model.output_layer(mine)  # outside it: every position
    return logits.detach(), mine.grad, model.output_layer.weight.grad, projected, plain.shape[0]


@pytest.mark.parametrize("tp, sequence_parallel, positions", [
    (1, False, [1, 4, 5, 9]),
    (2, False, [0, 3, 7]),
    (2, True, [1, 4, 5, 9]),
    (2, True, [2, 6, 8]),  # 3 rows: padded to 4
    (2, True, []),  # a micro-batch without trained tokens (a pipeline filler)
], ids=["tp1", "tp2", "tp2_sp", "tp2_sp_padded", "tp2_sp_none"])
def test_positions_equal_the_full_projection_then_the_rows(tp, sequence_parallel, positions):
    want_logits, want_hidden_grad, want_weight_grad = _reference(positions)
    k = len(positions)
    for rank, (logits, hidden_grad, weight_grad, projected, plain_rows) in enumerate(
            spawn(_at_positions, tp, tp, sequence_parallel, positions)):
        # the rows each rank projects: the k asked, padded under sequence parallelism to a multiple of tp (at least
        # one row a rank)
        assert projected == (max(tp, -(-k // tp) * tp) if sequence_parallel else k)
        torch.testing.assert_close(logits, want_logits.chunk(tp, dim=-1)[rank], rtol=0, atol=1e-6)
        grad = want_hidden_grad.chunk(tp)[rank] if sequence_parallel else want_hidden_grad
        torch.testing.assert_close(hidden_grad, grad, rtol=0, atol=1e-6)
        torch.testing.assert_close(weight_grad, want_weight_grad.chunk(tp)[rank], rtol=0, atol=1e-6)
        assert plain_rows == SEQ


def _rows_projected() -> tuple[list[int], int]:
    from pathlib import Path

    from rlhf_mc.config import ModelConfig, ParallelConfig
    from rlhf_mc.data.trajectory import Trajectories
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.workers.policy import compute_log_prob

    model = ModelConfig.from_yaml(Path(__file__).resolve().parents[1] / "model_configs" / "tiny-llama.yaml")
    init_parallel(ParallelConfig())
    (chunk,) = build_model(model, ParallelConfig())
    rows = []
    chunk.output_layer.register_forward_hook(lambda layer, args, out: rows.append(args[0].shape[0]))
    batch = Trajectories.single_turn([torch.arange(12), torch.arange(9)], [5, 2])  # 7 + 7 response tokens
    compute_log_prob([chunk], batch, micro_batch_tokens=64)
    return rows, int(batch.loss_mask.sum())


def test_the_log_prob_pass_projects_only_the_positions_of_response_tokens():
    ((rows, response_tokens),) = spawn(_rows_projected, 1)
    assert rows == [response_tokens] == [14]  # one micro-batch; of its 21 positions, the 14 predicting a response
