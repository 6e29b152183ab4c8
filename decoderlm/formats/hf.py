"""HF checkpoint folders: config.json + safetensors weights (one file, or shards listed in
model.safetensors.index.json) + tokenizer files + generation_config.json.

Loading builds the model on the meta device (no memory, no random init to throw away), allocates it
once in the requested dtype, and copies the checkpoint in one tensor at a time, read lazily from the
memory-mapped files: peak memory is the model plus one tensor. Each family's names and transforms
are in `decoderlm.formats.families`. gpt-oss's published experts, MXFP4 `_blocks` + `_scales` pairs, are
dequantized as they are read (`decoderlm.formats.mxfp4`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.formats.build import empty_model
from decoderlm.formats.families import IGNORED_SUFFIXES, Family, Row, expand, family_of, to_checkpoint, to_ours
from decoderlm.formats.mxfp4 import dequantize_hf_experts
from decoderlm.jsonio import read_json
from decoderlm.model import Transformer
from decoderlm.sampling import SamplingParams
from decoderlm.tokenizer import CharTokenizer
from decoderlm.tokenizer.bpe import HFTokenizer, IdsOnly, generation_defaults

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PROGRESS_BYTES = 256 * 2**20  # show a progress bar for checkpoints larger than this
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """The one reading of an HF config.json: loading, converting and `inspect` all go through it."""
    family = family_of(d.get("model_type"))
    restore = "restore the checkpoint's original config.json"
    try:
        fields = family.read(d)
    except KeyError as e:
        raise DecoderLMError(f"config.json lacks {e.args[0]!r}, which a {family.model_type} config needs; {restore}") from None
    except (TypeError, ValueError) as e:  # null or a string where a number belongs
        raise DecoderLMError(f"config.json has a value of the wrong type ({e}); {restore}") from None
    try:
        return ModelConfig(**fields)
    except DecoderLMError as e:
        raise DecoderLMError(f"config.json has a value of the wrong type or out of range ({e}); {restore}") from None


def loadable_config(d: dict[str, Any], where: str = "this checkpoint") -> ModelConfig:
    """`config_from_hf`, also refusing what `load_hf` cannot read beyond the config: pre-quantized weights other
    than gpt-oss's MXFP4 experts."""
    method = (d.get("quantization_config") or {}).get("quant_method", "pre-quantized")
    if d.get("quantization_config") and not (method == "mxfp4" and d.get("model_type") == "gpt_oss"):  # GPTQ, AWQ, FP8 layouts
        raise DecoderLMError(f"{where} holds {method} weights (config.json's quantization_config), which decoderlm does not read; "
                             "dequantize it with transformers and save_pretrained, then load that folder "
                             "(or pass --quantize int8/int4 to decoderlm)")
    return config_from_hf(d)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """config.json fields for this model. Refuses a config the family cannot express exactly (reading
    the result back must give the same model), so an exported checkpoint never means something else."""
    family = family_of(config.family)
    if family.write is None:
        raise DecoderLMError(f"decoderlm reads {family.model_type} folders but does not write them; save the model as another family")
    d = {"architectures": [family.architecture], "model_type": family.model_type, **family.write(config)}
    back = ModelConfig(**family.read(d))
    for f in dataclasses.fields(ModelConfig):
        if f.name != "dropout" and getattr(back, f.name) != getattr(config, f.name):
            ours, theirs = getattr(config, f.name), getattr(back, f.name)
            raise DecoderLMError(f"this model cannot be saved as an HF {family.model_type} checkpoint: {f.name}={ours!r} "
                                 f"has no {family.model_type} equivalent (it would load as {theirs!r})")
    return d


def load_hf(path: str | Path, torch_dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
            text: bool = True) -> tuple[Transformer, HFTokenizer | IdsOnly]:
    """(model in eval mode on `device`, tokenizer) from an HF folder. text=False: a folder without
    tokenizer.json loads too, with an `IdsOnly` tokenizer (token ids in and out)."""
    path = Path(path)
    d = read_config(path)
    config = loadable_config(d, str(path))
    family = family_of(d.get("model_type"))
    if family.unloaded:
        print(f"{family.model_type}: running {family.unloaded}", file=sys.stderr)
    if (path / "tokenizer.json").is_file():
        tokenizer = HFTokenizer.from_hf_folder(path)
    elif text:
        raise DecoderLMError(f"{path} has no tokenizer.json (decoderlm reads the fast-tokenizer file); copy the tokenizer "
                             "files from the original checkpoint into it, or drive it with token ids (generate --prompt-ids)")
    else:
        tokenizer = IdsOnly(path)
    mxfp4 = (d.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    model = load_weights(path, config, torch_dtype, device, family, mxfp4)
    model.generation_defaults = generation_defaults(path)
    return model.eval(), tokenizer


@torch.no_grad()
def load_weights(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                 family: Family | None = None, mxfp4: bool = False) -> Transformer:
    """The model with the folder's weights. family: the folder's, where it differs from the model's (a gemma3 folder
    holds a gemma3_text model); mxfp4: expert tensors may come as `_blocks` + `_scales` pairs, dequantized here."""
    family = family or family_of(config.family)
    model = empty_model(config, dtype, device)
    params = model.state_dict()
    table = expand(family, config, set(params))
    files = _weight_files(path)
    quiet = True if sum(f.stat().st_size for f in files) < PROGRESS_BYTES else None  # None: a bar on a terminal only
    seen: set[str] = set()
    halves: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 blocks or scales read before their other half
    with tqdm(total=len(table), desc=f"loading {path.name}", unit="tensor", disable=quiet, leave=False) as bar:
        for file in files:
            with _open(file) as f:
                for name in f.keys():
                    tensor = None
                    if mxfp4 and name.endswith(("_blocks", "_scales")):
                        name, tensor = _mxfp4_pair(name, f.get_tensor(name), halves)
                        if tensor is None:
                            continue
                    key = _table_key(name, table, family, config)
                    if key is None:
                        continue
                    _copy_in(table[key], f.get_tensor(name) if tensor is None else tensor, params)
                    seen.add(key)
                    bar.update()
    missing = [name for name in table if name not in seen]
    if missing:
        raise DecoderLMError(f"{path} lacks tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                             + "; the checkpoint is incomplete or does not match config.json: download it again")
    return model


def _weight_files(path: Path) -> list[Path]:
    if (path / INDEX_NAME).is_file():
        weight_map = read_json(path / INDEX_NAME, "shard index", "download the checkpoint's index file again").get("weight_map") or {}
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise DecoderLMError(f"{path / INDEX_NAME} lists {file.name}, which is missing; download all shards of the checkpoint")
        return files
    if (path / SINGLE_NAME).is_file():
        return [path / SINGLE_NAME]
    raise DecoderLMError(f"{path} has no {SINGLE_NAME} (or {INDEX_NAME} with shards); decoderlm reads safetensors only: "
                         "re-save the model with transformers' save_pretrained(...)")


@contextmanager
def _open(file: Path) -> Iterator[Any]:
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise DecoderLMError(f"{file} is not a readable safetensors file ({e}); it is truncated or corrupt: "
                             "download or convert it again") from None


def _mxfp4_pair(name: str, tensor: torch.Tensor, halves: dict[str, dict[str, torch.Tensor]]) -> tuple[str, torch.Tensor | None]:
    """(the experts tensor's name, its values) once both its `_blocks` and `_scales` are read (they may sit in
    different shards); (name, None) while one waits in `halves`."""
    base, half = name.rsplit("_", 1)
    halves.setdefault(base, {})[half] = tensor
    if len(halves[base]) < 2:
        return base, None
    pair = halves.pop(base)
    return base, dequantize_hf_experts(pair["blocks"], pair["scales"])


def _table_key(name: str, table: dict[str, Row], family: Family, config: ModelConfig) -> str | None:
    """The table entry for a checkpoint tensor; None for tensors that carry nothing we use."""
    aliased = [new + name[len(old):] for old, new in family.aliases if name.startswith(old)]
    for key in (name, family.optional_prefix + name, *aliased):
        if key in table:
            return key
    tied_head = config.tie_embeddings and "lm_head.weight" in (name, *aliased)
    if name.endswith(IGNORED_SUFFIXES) or name.startswith(family.skipped) or tied_head:
        return None
    if family.mtp_layers and (layer := re.match(r"model\.layers\.(\d+)\.", name)) and int(layer.group(1)) >= config.n_layers:
        return None
    raise DecoderLMError(f"the checkpoint has tensor {name}, which a {family.model_type} model with this config.json does not have; "
                         "config.json does not match the weights")


def _copy_in(row: Row, tensor: torch.Tensor, params: dict[str, torch.Tensor]) -> None:
    """Copy one checkpoint tensor into our parameter(s): transpose, split fused ones along dim 0, cast."""
    targets = [params[name] for name in row.ours]
    sizes = [t.shape[0] for t in targets]
    expected = (sum(sizes), *targets[0].shape[1:])
    if row.transpose:
        tensor = tensor.t()
    if row.layout and tensor.shape[0] == row.experts:
        tensor = to_ours(row, tensor)
    if tuple(tensor.shape) != expected:
        got, want = (tuple(tensor.shape), expected) if not row.transpose else (tuple(tensor.shape)[::-1], expected[::-1])
        raise DecoderLMError(f"tensor {row.ckpt} has shape {got} but config.json implies {want}; config.json does not match the weights")
    for target, piece in zip(targets, tensor.split(sizes)):
        target.copy_(piece)


# --- saving -------------------------------------------------------------------------------------

def save_hf(model: Transformer, tokenizer: Any, out_dir: str | Path, max_shard_size: int | str = "2GB") -> list[Path]:
    """Write an HF folder transformers can load: config.json, weights (sharded above max_shard_size),
    tokenizer files, and generation_config.json where there is something to say. Returns the weight files."""
    config = model.config
    hf = config_to_hf(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = model.state_dict()
    table = expand(family_of(config.family), config, set(params))
    tok = tokenizer.to_hf_tokenizer() if isinstance(tokenizer, CharTokenizer) else tokenizer
    eos = list(tok.eos_token_ids)
    pad = tok.token_id(tok.special_tokens["pad_token"])  # written even when None: some families default to ids beyond a small vocab
    hf.update(torch_dtype=str(next(model.parameters()).dtype).removeprefix("torch."), bos_token_id=tok.bos_token_id,
              eos_token_id=eos[0] if len(eos) == 1 else eos or None, pad_token_id=pad)
    for stale in [*out.glob("model*.safetensors"), out / INDEX_NAME]:  # shards of an earlier save would confuse loaders
        stale.unlink(missing_ok=True)
    files = _write_weights(list(table.values()), params, out, parse_size(max_shard_size))
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tok.save(out)
    generation = _generation_config(model.generation_defaults, hf["bos_token_id"], hf["eos_token_id"])
    if generation:
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return files


def _write_weights(rows: list[Row], params: dict[str, torch.Tensor], out: Path, limit: int) -> list[Path]:
    """Shards filled in table order: a new file whenever the next tensor would pass `limit`."""
    nbytes = [sum(params[name].numel() * params[name].element_size() for name in row.ours) for row in rows]
    shards: list[list[Row]] = [[]]
    size = 0
    for row, n in zip(rows, nbytes):
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(row)
        size += n
    names = [SINGLE_NAME] if len(shards) == 1 else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    quiet = True if sum(nbytes) < PROGRESS_BYTES else None  # None: tqdm shows the bar on a terminal only
    with tqdm(total=len(rows), desc=f"writing {out.name}", unit="tensor", disable=quiet, leave=False) as bar:
        for shard, name in zip(shards, names):
            save_file({row.ckpt: _checkpoint_tensor(row, params) for row in shard}, str(out / name), metadata={"format": "pt"})
            bar.update(len(shard))
    if len(shards) > 1:
        weight_map = {row.ckpt: name for shard, name in zip(shards, names) for row in shard}
        index = {"metadata": {"total_size": sum(nbytes)}, "weight_map": weight_map}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return [out / name for name in names]


def _checkpoint_tensor(row: Row, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """One row's checkpoint tensor: our parameters concatenated along dim 0, transposed for Conv1D."""
    tensor = torch.cat([params[name] for name in row.ours]) if len(row.ours) > 1 else params[row.ours[0]]
    return to_checkpoint(row, tensor.t() if row.transpose else tensor).contiguous().cpu()


def _generation_config(defaults: dict[str, Any], bos: int | None, eos: int | list[int] | None) -> dict[str, Any]:
    """generation_config.json for our sampling defaults (the inverse of `generation_defaults`); empty
    when the model has neither defaults nor stop tokens."""
    if not defaults and eos is None:
        return {}
    p = SamplingParams(**defaults)
    out: dict[str, Any] = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": p.temperature > 0}
    if p.temperature > 0:
        out.update(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
    return out | {"repetition_penalty": p.repetition_penalty}


def parse_size(size: int | str) -> int:
    """Bytes from 2000000, "500MB" or "2GiB" (KB/MB/GB are powers of 10, as in transformers)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", size.upper())
    if not match or float(match.group(1)) <= 0:
        raise DecoderLMError(f"shard size {size!r} is not a size; write it like 500MB or 2GB")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2) or ""])


def read_config(folder: Path) -> dict[str, Any]:
    """An HF folder's config.json as a dict."""
    return read_json(folder / "config.json", "config.json", "restore the checkpoint's original config.json next to its weights")
