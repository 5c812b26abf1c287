"""The SGLang model classes of the architectures the bridge maps (bridge/hf_config.py's ARCHITECTURES), given to our
servers as SGLang's external model package (SGLANG_EXTERNAL_MODEL_PACKAGE, set by rollout/sglang_server.py).

SGLang's model registry otherwise imports every one of its ~200 model modules at start-up: 6 s of each server start
on 2 cores (measured), against 0.2 s for these. An architecture not listed here still loads: the registry then falls
back to importing its whole default set."""
