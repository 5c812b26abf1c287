"""Runs a recipe: checks it, prints the plan, places the workers on Ray (a local instance, or the cluster at
--address / RAY_ADDRESS) and runs the RL loop.

    python tools/launch.py RECIPE [key=value ...] [--dry-run] [--address HOST:PORT]

Overrides are dotted paths into the recipe, values parsed as YAML: actor.optim.lr=1e-6 trainer.total_steps=20.
--dry-run prints the resolved recipe, the plan and the placement, and exits without starting anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf_mc.config import ConfigError  # noqa: E402
from rlhf_mc.runtime.console import quiet_framework_warnings  # noqa: E402
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
        if not args.dry_run:
            check_launch(recipe)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(yaml.safe_dump({"recipe": to_dict(recipe)}, sort_keys=False, default_flow_style=None).rstrip())
    print(f"model: {model.name or model.family}: {dataclasses.asdict(model)}")
    print("plan:")
    for line in plan.lines():
        print(f"  {line}")
    if args.dry_run:
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    quiet_framework_warnings()
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
    if received:
        print(f"stopped by {signal.Signals(received[0]).name}; every process the run started is gone; relaunch to "
              "continue from its last checkpoint", file=sys.stderr)
        return 128 + received[0]
    print("done:", {k: round(v, 4) for k, v in metrics.items() if k.startswith(("reward/", "val/"))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
