"""The teacher of on-policy distillation (recipe `teacher`): its log-probs of the student's own sampled tokens, from
an SGLang engine asked for them (prefill only) or from a Megatron worker group. Either gives a per-token tensor in
the trajectories' layout (data/trajectory.py: the value at token t is log p(t | the tokens before it)), read at the
loss-mask tokens: the advantage is algorithms/core.distillation_advantages of it and the student's old log-probs."""

from __future__ import annotations

import torch

from rlhf_mc.data.trajectory import Trajectories


class ServedTeacher:
    """A teacher served by SGLang (rollout/sglang_engine.SGLangEngine, launched by the trainer or attached): each
    sequence's log-probs from its first loss-mask token on, in one prefill."""

    def __init__(self, engine):
        self.engine = engine

    def logprobs(self, batch: Trajectories) -> torch.Tensor:
        rows, masks = batch.rows(), batch.rows(batch.loss_mask)
        starts = [int(mask.nonzero()[0]) if mask.any() else len(mask) - 1 for mask in masks]
        scored = self.engine.score([row.tolist() for row in rows], starts)
        return torch.cat([torch.cat([torch.zeros(start), torch.tensor(values, dtype=torch.float32)])
                          for start, values in zip(starts, scored)])


class MegatronTeacher:
    """A teacher run as its own Megatron worker group (trainer/placement.WorkerGroup) on the training devices, at
    temperature 1, the teacher's own distribution (as the served one's)."""

    def __init__(self, group, micro_batch_tokens: int):
        self.group, self.micro_batch_tokens = group, micro_batch_tokens

    def logprobs(self, batch: Trajectories) -> torch.Tensor:
        return self.group.logprobs(batch, 1.0, self.micro_batch_tokens)["logprobs"]


def token_logprobs(teacher, batch: Trajectories) -> torch.Tensor:
    """The default teacher.function: the teacher's log-probs of the batch's tokens as they are."""
    return teacher.logprobs(batch)


def distillation_metrics(batch: Trajectories) -> dict[str, float]:
    """Over the sampled tokens: the reverse KL's estimate (log p_student - log p_teacher, k1 of KL(student ||
    teacher)) and the agreement, the fraction the teacher gives p > 1/2 (it would have picked them greedily)."""
    mask = batch.loss_mask
    student, teacher = batch.fields["old_logprobs"][mask], batch.fields["teacher_logprobs"][mask]
    return {"teacher/reverse_kl": (student - teacher).mean().item(),
            "teacher/agreement": (teacher > -torch.log(torch.tensor(2.0))).float().mean().item(),
            "teacher/logprob_mean": teacher.mean().item()}
