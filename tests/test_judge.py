"""The LLM judge (rewards/judge.py): verdicts read from a real SGLang judge's answers (the session's tiny random model
answers garbage: every sample counted as a failure, none hangs), and the control flow of timeouts, errors, retries and
parsing against a stand-in HTTP judge (named so: a server that sleeps, fails or answers what the test says)."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from rlhf_mc.config import ConfigError
from rlhf_mc.rewards.judge import Judge, judge_scores, scores_and_stats
from rlhf_mc.trainer.recipe import JudgeSection

TEMPLATE = "Question: {question}\nAnswer: {response}\nReference: {reference}\nScore 0-10:"


def _judge_cfg(**kwargs) -> JudgeSection:
    return JudgeSection(path="judge", template=TEMPLATE, **kwargs)


class StandInJudge(http.server.ThreadingHTTPServer):
    """A stand-in judge server for the control-flow tests: /generate answers `answer` (token ids of the chat
    tokenizer), after sleeping `sleep_s`, or fails with HTTP 500 the first `failures` times. Records the requests."""

    def __init__(self, tokenizer, answer: str = "", sleep_s: float = 0.0, failures: int = 0):
        self.tokenizer, self.answer, self.sleep_s, self.failures = tokenizer, answer, sleep_s, failures
        self.requests: list[dict] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                time.sleep(outer.sleep_s)
                if outer.failures > 0:
                    outer.failures -= 1
                    self.send_response(500)
                    self.end_headers()
                    return
                out = json.dumps({"output_ids": outer.tokenizer.encode(outer.answer)}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                    pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def stand_in(chat_tokenizer):
    servers = []

    def make(**kwargs) -> StandInJudge:
        servers.append(StandInJudge(chat_tokenizer, **kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.shutdown()
        server.server_close()


def _score(cfg: JudgeSection, address: str, tokenizer, n: int = 3):
    judge = Judge(cfg, [address], tokenizer)
    try:
        return scores_and_stats(judge_scores, judge, [f"what is {i}+1?" for i in range(n)],
                                [f"{i + 1}" for i in range(n)], [f"{i + 1}" for i in range(n)])
    finally:
        judge.close()


def test_number_and_label_verdicts_and_the_message_the_judge_reads(stand_in, chat_tokenizer):
    server = stand_in(answer="I would say 7 out of 10.")
    scores, stats = _score(_judge_cfg(weight=2.0), server.address, chat_tokenizer)
    assert scores == [pytest.approx(1.4)] * 3 and stats["reward/judge_mean"] == pytest.approx(0.7)
    assert stats["reward/judge_failures"] == 0 and stats["reward/judge_timeouts"] == 0
    # the calls run at once: find the first sample's among them
    (sent,) = [text for text in (chat_tokenizer.decode(r["input_ids"]) for r in server.requests) if "0+1" in text]
    assert "<|im_start|>user\nQuestion: what is 0+1?\nAnswer: 1\nReference: 1\nScore 0-10:<|im_end|>" in sent
    assert sent.endswith("<|im_start|>assistant\n")  # the judge's turn
    assert server.requests[0]["sampling_params"]["temperature"] == 0.0
    labels = _judge_cfg(parser=r"\b(correct|wrong)\b", labels={"correct": 1.0, "wrong": -1.0})
    assert _score(labels, stand_in(answer="That is wrong.").address, chat_tokenizer)[0] == [-1.0] * 3
    # a number out of score_range is no verdict
    scores, stats = _score(_judge_cfg(failure_score=-0.5), stand_in(answer="42").address, chat_tokenizer)
    assert scores == [-0.5] * 3 and stats["reward/judge_failures"] == 3 and "reward/judge_mean" not in stats


def test_a_judge_that_sleeps_times_out_retries_and_never_holds_the_step(stand_in, chat_tokenizer):
    server = stand_in(answer="10", sleep_s=3.0)
    start = time.perf_counter()
    scores, stats = _score(_judge_cfg(timeout_s=0.3, retries=1, failure_score=0.25, concurrency=4), server.address,
                           chat_tokenizer, n=4)
    elapsed = time.perf_counter() - start
    assert scores == [0.25] * 4
    assert stats["reward/judge_failures"] == 4 and stats["reward/judge_timeouts"] == 8  # two attempts each
    assert len(server.requests) == 8
    assert elapsed < 2.0  # 4 calls at once, 2 x 0.3 s each: not the judge's 3 s


def test_a_failed_call_is_retried(stand_in, chat_tokenizer):
    server = stand_in(answer="5", failures=2)
    scores, stats = _score(_judge_cfg(retries=1, concurrency=1), server.address, chat_tokenizer, n=2)
    # one call at a time: the first fails twice (no verdict), the second answers
    assert scores == [0.0, 0.5] and stats["reward/judge_errors"] == 2 and stats["reward/judge_failures"] == 1


def test_a_real_judge_engine_that_answers_garbage_is_counted(sglang_engine, chat_tokenizer):
    """The session's tiny random model as the judge: real answers (random characters), no verdict in them."""
    address = sglang_engine.urls[0].removeprefix("http://")
    cfg = _judge_cfg(parser=r"Score: (\d+)", parser_example="Score: 3", max_new_tokens=8, timeout_s=60)
    judge = Judge(cfg, [address], chat_tokenizer)
    try:
        texts = [judge.message(f"q{i}", f"r{i}", "x") for i in range(3)]
        answers = judge.ask(texts)
        assert all(isinstance(a, str) and a for a in answers)  # the engine answered each
        scores, stats = scores_and_stats(judge_scores, judge, ["q0", "q1", "q2"], ["r0", "r1", "r2"], ["x"] * 3)
    finally:
        judge.close()
    assert scores == [0.0] * 3
    assert stats == {"reward/judge_failures": 3, "reward/judge_timeouts": 0, "reward/judge_errors": 0}


def reference_only_judge(judge, prompts, responses, answers):
    """A user's judge.function: asks whether each response equals its reference, in its own words, and reads the
    verdict with the recipe's parser."""
    return [judge.verdict(a) for a in judge.ask([f"Is {r} equal to {ref}?" for r, ref in zip(responses, answers)])]


def test_a_judge_function_by_import_path(stand_in, chat_tokenizer):
    from rlhf_mc.config import import_by_path

    server = stand_in(answer="9")
    judge = Judge(_judge_cfg(), [server.address], chat_tokenizer)
    try:
        function = import_by_path("judge.function", "tests.test_judge:reference_only_judge")
        scores, stats = scores_and_stats(function, judge, ["q"], ["7"], ["8"])
    finally:
        judge.close()
    assert scores == [pytest.approx(0.9)] and stats["reward/judge_mean"] == pytest.approx(0.9)
    assert "Is 7 equal to 8?" in chat_tokenizer.decode(server.requests[0]["input_ids"])


@pytest.mark.parametrize("overrides, message", [
    (["judge.template='{question}'"], r"^judge\.template: '\{question\}' has no \{response\} placeholder"),
    (["judge.parser='Score: ([0-9]+)'"], r"^judge\.parser: 'Score: \(\[0-9\]\+\)' reads no verdict from '0'"),
    (["judge.labels={'good': 1}"], r"^judge\.parser: .* reads no verdict from 'good'"),
    (["judge.parser='(a)(b)'"], r"^judge\.parser: .* has 2 groups"),
    (["judge.path=", "judge.template='{response}'"], r"^judge\.path: judge settings \['template'\] without a judge"),
    (["judge.engine.request_timeout_s=5"], r"^judge\.engine\.request_timeout_s: 5\.0 is not read for the judge: set "
                                            r"judge\.timeout_s"),
])
def test_bad_judge_settings_are_refused_by_name(overrides, message):
    from rlhf_mc.trainer.recipe import load_recipe

    with pytest.raises(ConfigError, match=message):
        load_recipe("recipes/quickstart.yaml", ["judge.path=judge", "judge.template='{response}'", *overrides])
