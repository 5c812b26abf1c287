"""LoRA adapters as PEFT directories: adapter_config.json + adapter_model.safetensors, PEFT's names and shapes for
the HF causal LM (models/lora.peft_name), so that `peft.PeftModel.from_pretrained(hf_base, dir)` loads what we
train and we start from what PEFT trained. Written to a temp dir and renamed when complete."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from rlhf_mc.config import ConfigError, LoraConfig, ModelConfig
from rlhf_mc.models.lora import adapter_shapes

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PART = re.compile(r"\.(\w+)\.lora_[AB]\.weight$")  # the HF module of a PEFT tensor name


def peft_config(lora: LoraConfig, base_model: str) -> dict:
    """adapter_config.json of our adapters."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": sorted(lora.targets), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "modules_to_save": None, "inference_mode": True}


def write_peft_adapter(out: str | Path, tensors: dict[str, torch.Tensor], lora: LoraConfig, base_model: str) -> None:
    """`tensors`: PEFT name -> full tensor (models/lora.full_tensors)."""
    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / CONFIG).write_text(json.dumps(peft_config(lora, base_model), indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def read_peft_adapter(path: str | Path, lora: LoraConfig, model: ModelConfig,
                      field: str = "actor.lora.adapter_path") -> dict[str, torch.Tensor]:
    """The adapter's full tensors, checked against the recipe's LoRA fields and the base model: one-line
    ConfigErrors naming the field and the value."""
    from safetensors import safe_open

    path = Path(path)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise ConfigError(f"{field}: {path} is not a PEFT adapter directory (needs {CONFIG} and {WEIGHTS})")
    config = json.loads((path / CONFIG).read_text())
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{field}: {path}: peft_type {config.get('peft_type')!r}, only LORA adapters load")
    unsupported = {k: config[k] for k in ("use_rslora", "use_dora", "fan_in_fan_out") if config.get(k)}
    if config.get("bias", "none") != "none":
        unsupported["bias"] = config["bias"]
    if config.get("modules_to_save"):
        unsupported["modules_to_save"] = config["modules_to_save"]
    if unsupported:
        raise ConfigError(f"{field}: {path}: unsupported PEFT settings {unsupported}")
    targets = config.get("target_modules")
    targets = sorted(targets) if isinstance(targets, list) else targets
    for name, ours, theirs in (("rank", lora.rank, config.get("r")), ("alpha", lora.alpha, config.get("lora_alpha")),
                               ("target_modules", sorted(lora.targets), targets)):
        if ours != theirs:
            raise ConfigError(f"actor.lora.{name}: {ours}, but the adapter at {path} has {theirs}: set it to match")
    expected = adapter_shapes(model, lora)
    tensors = {}
    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        for name in f.keys():
            if name not in expected:
                raise ConfigError(f"{field}: {path}: tensor {name} is not one of this model's adapters (layers "
                                  f"0-{model.num_layers - 1}, {', '.join(lora.targets)}): another base model?")
            part, want = _PART.search(name).group(1), list(expected[name])
            got = list(f.get_slice(name).get_shape())
            if got != want:
                raise ConfigError(f"{field}: {path}: {name} has shape {got}, this model's {part} needs {want}: "
                                  "another base model?")
            tensors[name] = f.get_tensor(name)
    missing = sorted(expected.keys() - tensors.keys())
    if missing:
        raise ConfigError(f"{field}: {path}: {len(missing)} adapter tensors missing, e.g. {missing[0]}")
    return tensors
