"""On-policy distillation: the advantage by hand (masks, aggregation, mixed with an outcome estimator), the served
teacher's log-probs (SGLang, prefill only) equal the Megatron teacher's (TP=2) on the same multi-turn token layout,
and a teacher of another vocabulary refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_mc.algorithms import core
from rlhf_mc.config import ConfigError, ParallelConfig
from rlhf_mc.data.trajectory import Trajectories
from rlhf_mc.runtime.spawn import spawn

# two sequences, the first with a gap in its loss mask (a tool result between two assistant turns)
OLD = torch.tensor([[-1.0, -2.0, -0.5, -3.0, 0.0], [-3.0, -1.0, 0.0, 0.0, 0.0]])
TEACHER = torch.tensor([[-0.5, -9.0, -1.5, -1.0, 0.0], [-1.0, -1.5, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)


def test_distillation_advantage_by_hand():
    adv = core.distillation_advantages(OLD, TEACHER, MASK, coef=1.0)
    # teacher - student on the sampled tokens; the tool token (-9 vs -2) and the padding get nothing
    assert adv.tolist() == [[0.5, 0.0, -1.0, 2.0, 0.0], [2.0, -0.5, 0.0, 0.0, 0.0]]
    assert core.distillation_advantages(OLD, TEACHER, MASK, coef=0.5).tolist()[1][:2] == [1.0, -0.25]
    # at ratio 1 the policy loss is -A per token, reduced by each aggregation mode: token-mean -(0.5-1+2+2-0.5)/5,
    # seq-mean-token-mean -((1.5/3)+(1.5/2))/2, seq-mean-token-sum -(1.5+1.5)/2
    for mode, expected in (("token-mean", -0.6), ("seq-mean-token-mean", -0.625), ("seq-mean-token-sum", -1.5)):
        loss, _ = core.policy_loss(OLD, OLD, adv, MASK, aggregation=mode)
        assert loss.item() == pytest.approx(expected), mode


def _recipe(*overrides):
    from rlhf_mc.trainer.recipe import load_recipe

    return load_recipe("recipes/quickstart.yaml", ["teacher.path=unused", *overrides])


def _batch(scores) -> Trajectories:
    tokens = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]]
    rows = Trajectories.from_rows(tokens, MASK.tolist(), scores=scores, groups=[0, 0])
    return rows.with_fields(old_logprobs=rows.unpadded(OLD), teacher_logprobs=rows.unpadded(TEACHER))


def test_the_loop_adds_the_teacher_advantage_to_the_estimators():
    from rlhf_mc.trainer.loop import advantages

    distill = torch.tensor([0.5, 0.0, -1.0, 2.0, 0.0, 2.0, -0.5, 0.0, 0.0, 0.0])
    out, _ = advantages(_recipe("algorithm.estimator=distill"), _batch([1.0, 0.0]))
    assert out["advantages"].tolist() == distill.tolist()
    # GRPO on scores 1 and 0: +-0.5 / (std 0.7071 + 1e-6) on each sampled token, plus the teacher's at kl_coef 2
    out, _ = advantages(_recipe("teacher.kl_coef=2"), _batch([1.0, 0.0]))
    grpo = 0.5 / (math.sqrt(0.5) + 1e-6)
    outcome = torch.tensor([grpo, 0, grpo, grpo, 0, -grpo, -grpo, 0, 0, 0])
    assert torch.allclose(out["advantages"], outcome + 2 * distill)


def test_a_teacher_turns_the_old_logprob_pass_on():
    assert _recipe("algorithm.estimator=distill").old_logprobs_from_update is False
    from rlhf_mc.trainer.recipe import load_recipe

    assert load_recipe("recipes/quickstart.yaml").old_logprobs_from_update is True


SEQUENCES = [[5, 6, 7, 8, 9, 10, 11], [200, 3, 4, 40, 41, 42, 43, 44, 45], [9, 8, 7, 6]]
MASKS = [[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 1, 1, 1], [0, 1, 1, 1]]  # the second: two turns and a tool result


def _megatron_teacher(model_dir: str) -> list[float]:
    from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config
    from rlhf_mc.bridge.weights import load_hf_weights
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.workers.policy import compute_log_prob

    parallel = ParallelConfig(tp=2)
    model = model_config_from_hf(read_hf_config(model_dir))
    init_parallel(parallel)
    chunks = build_model(model, parallel, init_weights=False)
    load_hf_weights(chunks, model_dir, model)
    batch = Trajectories.from_rows(SEQUENCES, MASKS)
    return compute_log_prob(chunks, batch, 1.0)["logprobs"].tolist()


def test_served_teacher_logprobs_equal_the_megatron_teachers(sglang_engine, tiny_hf_model):
    from rlhf_mc.trainer.teacher import ServedTeacher

    batch = Trajectories.from_rows(SEQUENCES, MASKS)
    served = ServedTeacher(sglang_engine).logprobs(batch)
    megatron = torch.tensor(spawn(_megatron_teacher, 2, str(tiny_hf_model))[0])
    mask = batch.loss_mask
    assert served.shape == megatron.shape
    assert (served[mask] - megatron[mask]).abs().max() < 1e-4  # fp32 noise, two engines
    assert served[mask].std() > 0.1  # not a constant
    # before each sequence's first sampled token nothing is scored
    assert served[~mask][:3].tolist() == [0.0, 0.0, 0.0]


HINT = [3, 4, 5]


def hinted_teacher(teacher, batch: Trajectories) -> torch.Tensor:
    """A user's teacher.function: the teacher reads HINT before each sequence (a privileged prompt, say) and scores
    the student's tokens after it, through the served engine's score."""
    starts = [int(mask.nonzero()[0]) for mask in batch.rows(batch.loss_mask)]
    scored = teacher.engine.score([HINT + row.tolist() for row in batch.rows()], [len(HINT) + s for s in starts])
    return torch.cat([torch.cat([torch.zeros(s), torch.tensor(v)]) for s, v in zip(starts, scored)])


def test_a_teacher_function_by_import_path_scores_what_it_chooses(sglang_engine, tiny_hf_model):
    import transformers as T

    from rlhf_mc.config import import_by_path
    from rlhf_mc.trainer.teacher import ServedTeacher

    batch = Trajectories.from_rows(SEQUENCES, MASKS)
    out = import_by_path("teacher.function", "tests.test_distill:hinted_teacher")(ServedTeacher(sglang_engine), batch)
    model = T.AutoModelForCausalLM.from_pretrained(tiny_hf_model, dtype=torch.float32).eval()
    for row, mask, values in zip(SEQUENCES, MASKS, batch.rows(out)):
        with torch.no_grad():  # transformers on HINT + the sequence, each token given the tokens before it
            logp = torch.log_softmax(model(torch.tensor([HINT + row])).logits[0].float(), -1)
        expected = torch.tensor([logp[len(HINT) + t - 1, row[t]] for t in range(len(row))])
        first = mask.index(1)
        assert (values[first:] - expected[first:]).abs().max() < 1e-4 and values[:first].eq(0).all()


def test_a_teacher_with_another_vocabulary_is_refused_by_name(tmp_path):
    from rlhf_mc.trainer.plan import check_launch
    from rlhf_mc.trainer.recipe import load_recipe, model_config
    from tests.conftest import write_chat_tokenizer

    teacher = write_chat_tokenizer(tmp_path / "teacher")
    (teacher / "config.json").write_text("{}")
    recipe = load_recipe("recipes/quickstart.yaml", [f"teacher.path={teacher}", "algorithm.estimator=distill"])
    with pytest.raises(ConfigError, match=r"^teacher\.path: .* tokenizes differently from the actor"):
        check_launch(recipe, model_config(recipe))
    with pytest.raises(ConfigError, match=r"^algorithm\.estimator: distill learns from a teacher"):
        load_recipe("recipes/quickstart.yaml", ["algorithm.estimator=distill"])
    with pytest.raises(ConfigError, match=r"^teacher\.engine: set with teacher\.backend=megatron"):
        load_recipe("recipes/quickstart.yaml", ["teacher.path=x", "teacher.backend=megatron", "teacher.engine.tp=2"])
    for override, message in (("teacher.engine.host=10.0.0.1", r"^teacher\.engine\.host: '10\.0\.0\.1': set by the"),
                              ("teacher.engine.max_restarts=1", r"^teacher\.engine\.max_restarts: 1: a served model"),
                              ("teacher.micro_batch_tokens=100", r"^teacher\.micro_batch_tokens: 100 is the Megatron")):
        with pytest.raises(ConfigError, match=message):
            load_recipe("recipes/quickstart.yaml", ["teacher.path=x", override])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["engine", "megatron"])
def test_distillation_run_with_a_teacher_and_a_judge(backend, ray_address, tmp_path):
    """tools/launch.py with a teacher (a random model of the quickstart's architecture and tokenizer; served by its
    own SGLang engine, or run as a Megatron worker group offloaded while the engines generate) and, served, the
    same model as a judge: each step's loss is
    the teacher's advantage alone (on-policy, ratio 1: the token-mean policy loss is the mean reverse KL, computed in
    the driver from the teacher's and the student's log-probs), and the judge's random answers are scored or
    counted, none timing out."""
    import json
    import shutil
    import subprocess
    import sys

    import transformers as T

    from rlhf_mc.bridge.hf_config import hf_config_from_model
    from rlhf_mc.config import ModelConfig
    from tests.conftest import ray_env
    from tests.test_trainer import ONE_SLOT, REPO

    teacher = tmp_path / "teacher"
    config = hf_config_from_model(ModelConfig.from_yaml(REPO / "model_configs/tiny-arith.yaml"))
    torch.manual_seed(1)
    T.AutoModelForCausalLM.from_config(T.AutoConfig.for_model(**config)).save_pretrained(teacher)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "recipes/data/arith" / name, teacher)
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "tools/launch.py", "recipes/quickstart.yaml", "--address", ray_address,
         f"trainer.output_dir={out}", "sft.data_path=", "trainer.total_steps=2", *ONE_SLOT, "data.train_batch_size=8",
         "actor.ppo_mini_batch_size=8", "rollout.n=2",
         "data.val_path=", "trainer.loggers=[jsonl]", f"teacher.path={teacher}", f"teacher.backend={backend}",
         *(["teacher.offload=true"] if backend == "megatron" else []),
         "algorithm.estimator=distill", f"judge.path={teacher}", "judge.chat_template=false",
         "judge.template='{question}{response}='", "judge.max_new_tokens=4", "judge.score_range=[0,200]"],
        cwd=REPO, env=ray_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["actor/pg_loss"] == pytest.approx(s["teacher/reverse_kl"], abs=1e-5)
        assert abs(s["teacher/reverse_kl"]) > 1e-3 and s["teacher/logprob_mean"] < 0
        assert s["rollout/logprob_diff"] < 1e-4
        assert s["reward/judge_timeouts"] == 0 and s["reward/judge_errors"] == 0
        assert 0 <= s["reward/judge_failures"] <= 16
    assert (out / "logs" / "teacher0").is_dir() == (backend == "engine")

