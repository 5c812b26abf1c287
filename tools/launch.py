"""Runs a recipe: checks it, prints the plan, places the workers on Ray (a local instance, or the cluster at
--address / RAY_ADDRESS) and runs the RL loop.

    python tools/launch.py RECIPE [key=value ...] [--dry-run] [--address HOST:PORT]

Overrides are dotted paths into the recipe, values parsed as YAML: actor.optim.lr=1e-6 trainer.total_steps=20.
--dry-run runs every check a launch runs before Ray starts, prints the resolved recipe, the plan and the
placement, and exits without starting anything. A launch prints one screen (the plan) and then progress bars; the
resolved recipe goes to <output_dir>/recipe.json, what the run logs to <output_dir>/launch.log.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf_mc.config import ConfigError  # noqa: E402
from rlhf_mc.runtime.console import FILE_ONLY, log_run  # noqa: E402
from rlhf_mc.trainer.plan import check_launch, make_plan  # noqa: E402
from rlhf_mc.trainer.recipe import load_recipe, model_config, to_dict  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="key=value")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved recipe, plan and placement")
    parser.add_argument("--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS or local)")
    args = parser.parse_intermixed_args(argv)  # options may come before, between or after the overrides
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        model = model_config(recipe)
        plan = make_plan(recipe, model)
        check_launch(recipe, model)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(yaml.safe_dump({"recipe": to_dict(recipe)}, sort_keys=False, default_flow_style=None).rstrip())
    print("\n".join(screen(args.recipe, recipe, model, plan)))
    if args.dry_run:
        return 0
    log_file = Path(recipe.trainer.output_dir) / "launch.log"
    log_run(log_file)
    from rlhf_mc.trainer.loop import Stop, train

    # SIGTERM / Ctrl-C: within the steps the step under way finishes and is logged (a second signal stops at once);
    # elsewhere at once. Either way the trainer's clean-up (engines, workers, Ray) runs on the way out and nothing it
    # started is left.
    stop, received = Stop(), []

    def on_signal(signum, frame):
        received.append(signum)
        if stop.request():
            raise KeyboardInterrupt(signal.Signals(signum).name)
        print(f"{signal.Signals(signum).name}: stopping after this step (again to stop now)", file=sys.stderr)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        metrics = train(recipe, plan, args.address, stop)
    except KeyboardInterrupt:
        metrics = {}
    except ConfigError as e:  # what only the cluster tells: where Ray placed the ranks, attached servers' limits
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - one line here, the whole traceback in the log
        logging.getLogger("rlhf_mc.launch").error("the run failed", exc_info=True, extra=FILE_ONLY)
        print(f"error: {_last_line(e)} (traceback in {log_file})", file=sys.stderr)
        return 1
    if received:
        print(f"stopped by {signal.Signals(received[0]).name}; every process the run started is gone; relaunch to "
              "continue from its last checkpoint", file=sys.stderr)
        return 128 + received[0]
    print("done:", {k: round(v, 4) for k, v in metrics.items() if k.startswith(("reward/", "val/"))})
    return 0


def _last_line(e: BaseException) -> str:
    """An exception in one line: its last non-empty line (a Ray task error ends with the remote exception's)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


def screen(path: str, recipe, model, plan) -> list[str]:
    """What a launch prints before its progress bars: the run's folder, the model, the task, the plan."""
    m, data, r, sft = recipe.model, recipe.data, recipe.rollout, recipe.sft
    start = f"from {m.path}" if m.path else "random init"
    if sft.data_path:
        start += f", then SFT ({sft.steps} steps x {sft.batch_size} sequences)"
    size = f"{model.num_parameters / 1e6:.3g}M parameters, {model.num_layers} layers x {model.hidden_size}"
    if model.num_experts:
        size += f", {model.num_experts} experts (top {model.moe_topk})"
    steps = f"{recipe.trainer.total_steps} steps" if recipe.trainer.total_steps else \
        f"{recipe.trainer.total_epochs} epoch(s)"
    engine = r.engine
    engines = (f"{engine.num_engines} attached ({', '.join(engine.addresses)})" if engine.addresses else
               f"{engine.num_engines} launched, tp={engine.tp}, {engine.dtype}")
    val = f"validation every {recipe.trainer.val_interval} steps" if recipe.trainer.val_interval else \
        "validation at the start and the end"
    lines = [f"rlhf_mc: {path} -> {recipe.trainer.output_dir}/ (metrics.jsonl, launch.log, recipe.json, "
             "checkpoints/, final_hf/)",
             f"model: {model.name or model.family} ({model.family}; {size}), {m.dtype}; {start}"]
    if not sft.only:
        rewards = [x for x in (recipe.reward.function, recipe.reward.model) if x]
        rewards += [f"judge {recipe.judge.path}"] if recipe.judge.enabled else []
        lines.append(f"task: {recipe.algorithm.estimator}, {steps} of {data.train_batch_size} prompts x {r.n} "
                     f"samples, reward {' + '.join(rewards)}"
                     + (f"; {val} ({data.val_size or 'all'} prompts)" if data.val_path else ""))
        lines.append(f"engines: SGLang, {engines}; rollout {r.mode}, {r.placement}")
        for name, section in (("teacher", recipe.teacher), ("judge", recipe.judge)):
            if section.path and (name == "judge" or section.backend == "engine"):
                e = section.engine
                where = (f"attached ({', '.join(e.addresses)})" if e.addresses else
                         f"{e.num_engines} launched on the rollout engines' devices, tp={e.tp}, {e.dtype}")
                lines.append(f"{name}: {section.path}, SGLang, {where}")
            elif section.path:
                lines.append(f"{name}: {section.path}, Megatron worker group on the training devices, "
                             f"tp={section.parallel.tp} pp={section.parallel.pp}")
    return lines + ["plan:", *(f"  {line}" for line in plan.lines())]


if __name__ == "__main__":
    sys.exit(main())
