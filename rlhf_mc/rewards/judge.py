"""A generative reward (recipe `judge`): an LLM judge served by SGLang reads each response in the recipe's template and
answers; a regular expression reads the verdict (a number in a range, or a label), which becomes a score.

Calls go to the judge's servers over HTTP, `concurrency` at a time (beside the rule's scoring), each with its own
timeout; a call that times out or fails is retried `retries` times. An answer without a verdict is not retried (the
judge answers greedily: the same question gets the same answer). Every call ends in a score or in None (no verdict),
which the caller scores as judge.failure_score; the counts are the step's reward/judge_* metrics."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import re
import threading

from typing import TYPE_CHECKING

import requests

if TYPE_CHECKING:
    from rlhf_mc.trainer.recipe import JudgeSection

log = logging.getLogger(__name__)


class Judge:
    def __init__(self, cfg: JudgeSection, addresses: list[str], tokenizer):
        """`tokenizer`: the judge's (the servers take and give token ids: rollout/sglang_server.py)."""
        self.cfg, self.urls, self.tokenizer = cfg, [f"http://{a}" for a in addresses], tokenizer
        self.pattern = re.compile(cfg.parser)
        self.pool = concurrent.futures.ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="judge")
        self.session = requests.Session()
        self.session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=cfg.concurrency))
        self.counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._next = 0

    def message(self, question: str, response: str, reference: str) -> str:
        """The judge's input: the template filled in."""
        return self.cfg.template.format(question=question, response=response, reference=reference)

    def _input_ids(self, text: str) -> list[int]:
        if not self.cfg.chat_template:
            return self.tokenizer.encode(text)
        return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)

    def _count(self, what: str) -> int:
        """Counts one more of `what`; returns how many since the last take."""
        with self._lock:
            self.counts[what] += 1
            return self.counts[what]

    def _ask_one(self, text: str) -> str | None:
        request = {"input_ids": self._input_ids(text),
                   "sampling_params": {"temperature": 0.0, "max_new_tokens": self.cfg.max_new_tokens,
                                       "stop_token_ids": [self.tokenizer.eos_token_id]}}
        for attempt in range(self.cfg.retries + 1):
            with self._lock:  # round-robin over the judge's servers
                url, self._next = self.urls[self._next % len(self.urls)], self._next + 1
            try:
                response = self.session.post(url + "/generate", json=request, timeout=self.cfg.timeout_s)
                response.raise_for_status()
                return self.tokenizer.decode(response.json()["output_ids"], skip_special_tokens=True)
            except requests.Timeout:
                self._count("timeouts")
            except (requests.RequestException, ValueError, KeyError, IndexError) as error:
                if self._count("errors") == 1:
                    log.warning("judge call failed (attempt %d): %r", attempt + 1, error)
        return None

    def ask(self, texts: list[str]) -> list[str | None]:
        """The judge's answers, None where every attempt timed out or failed."""
        return list(self.pool.map(self._ask_one, texts))

    def verdict(self, answer: str | None) -> float | None:
        """The score the parser reads from an answer (the first match), None if there is none."""
        if answer is None:
            return None
        match = self.pattern.search(answer)
        return None if match is None else self.cfg.verdict(match.group(1))

    def take_counts(self) -> dict[str, int]:
        """The calls' timeouts and errors since the last take."""
        with self._lock:
            out, self.counts = dict(self.counts), collections.Counter()
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.session.close()


def judge_scores(judge: Judge, prompts: list[str], responses: list[str], answers: list[str]) -> list[float | None]:
    """The default judge.function: each response judged once, with its question and reference answer."""
    texts = [judge.message(q, r, a) for q, r, a in zip(prompts, responses, answers, strict=True)]
    return [judge.verdict(answer) for answer in judge.ask(texts)]


def scores_and_stats(function, judge: Judge, prompts: list[str], responses: list[str], answers: list[str]
                     ) -> tuple[list[float], dict[str, float]]:
    """A judge function's scores (weighted; None -> failure_score) and the step's reward/judge_* metrics: the mean
    judged score, the samples without a verdict (reward/judge_failures), the calls timed out and failed."""
    cfg = judge.cfg
    verdicts = function(judge, prompts, responses, answers)
    if len(verdicts) != len(responses):
        raise ValueError(f"judge.function returned {len(verdicts)} scores for {len(responses)} responses")
    judged = [v for v in verdicts if v is not None]
    counts = judge.take_counts()
    stats = {"reward/judge_failures": len(verdicts) - len(judged),
             "reward/judge_timeouts": counts.get("timeouts", 0), "reward/judge_errors": counts.get("errors", 0),
             **({"reward/judge_mean": sum(judged) / len(judged)} if judged else {})}
    return [cfg.weight * (cfg.failure_score if v is None else v) for v in verdicts], stats
