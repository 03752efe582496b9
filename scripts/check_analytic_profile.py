"""How far an analytic profile (common/profiles.py) is from Baton's engine measured on that
GPU. A device check (scripts/check_cuda.sh does not run it: it writes a 16 GB checkpoint).

    PYTHONPATH=. python scripts/check_analytic_profile.py --gpu h200 --model llama-3-8b \\
        --device cuda --work-dir /tmp/l3-8b [--json]

Writes a checkpoint with the model's published shapes (common.profiles.MODELS) and random
weights, measures it with the profiler (the engine's real steps: prefill over cached
context, decode over batch and context), and prints each point's measured step time
beside the roofline's for that GPU at tp=1 (prefill_seconds / decode_seconds), and the
median measured/analytic ratio per phase. The measured profile is written to
<work-dir>/profile.json. `--layers N` shrinks the model to N layers (the roofline too),
for a dry run on a CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.engine.checkpoint import TOKENIZER_FILE, expected_tensors, load_model_config
from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import Engine
from common.logs import configure_logging
from common.profiles import GPUS, MODELS, ModelShape, decode_seconds, prefill_seconds
from services.eval.profiler import Grid, Point, describe_machine, measure, profile_json

GRID = Grid(prefill_tokens=(64, 256, 1024, 4096), prefill_contexts=(0, 2048),
            decode_batches=(1, 8, 32, 128), decode_contexts=(256, 2048), repeats=3)
DRY_GRID = Grid((16, 128), (0, 128), (1, 4), (64,), repeats=2)
WEIGHT_STD = 0.02


def hf_config(shape: ModelShape) -> dict:
    """config.json of a Llama-architecture checkpoint with `shape`'s dimensions."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_context, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": shape.tied_embeddings,
        "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
    }


def write_checkpoint(shape: ModelShape, directory: Path, device: str) -> None:
    """Random bf16 weights (drawn on `device`, which is fast on a GPU), the config, and the
    default model's tokenizer (ids past its vocabulary decode to nothing)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(shape), indent=2), encoding="utf-8")
    tokenizer_dir = default_model_dir()
    for name in (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    generator = torch.Generator(device).manual_seed(0)
    tensors = {}
    for name, size in expected_tensors(load_model_config(directory)).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(size, dtype=torch.bfloat16)
        else:
            values = torch.randn(size, generator=generator, device=device, dtype=torch.bfloat16)
            tensors[name] = (values * WEIGHT_STD).cpu()
    partial = directory / "model.safetensors.partial"  # renamed once whole: a rerun reuses only whole files
    save_file(tensors, str(partial))
    partial.rename(directory / "model.safetensors")


def analytic_seconds(point: Point, gpu_key: str, shape: ModelShape) -> float:
    gpu = GPUS[gpu_key]
    if point.phase == "prefill":
        return prefill_seconds(gpu, shape, 1, point.n, int(point.ctx))
    return decode_seconds(gpu, shape, 1, point.n, point.ctx)


def compare(points: list[Point], gpu_key: str, shape: ModelShape) -> dict:
    """Per point and per phase: measured seconds, analytic seconds and their ratio."""
    rows = [{"phase": p.phase, "n": p.n, "ctx": p.ctx, "measured_ms": p.seconds * 1e3,
             "analytic_ms": analytic_seconds(p, gpu_key, shape) * 1e3} for p in points]
    for row in rows:
        row["ratio"] = row["measured_ms"] / row["analytic_ms"]
    phases = {}
    for phase in ("prefill", "decode"):
        ratios = [row["ratio"] for row in rows if row["phase"] == phase]
        phases[phase] = {"median_ratio": statistics.median(ratios), "min_ratio": min(ratios),
                         "max_ratio": max(ratios), "points": len(ratios)}
    return {"points": rows, "phases": phases}


def print_table(result: dict) -> None:
    print(f"{'phase':8} {'n':>5} {'ctx':>7} {'measured ms':>12} {'analytic ms':>12} {'ratio':>6}")
    for row in result["points"]:
        print(f"{row['phase']:8} {row['n']:5d} {row['ctx']:7.0f} {row['measured_ms']:12.2f} "
              f"{row['analytic_ms']:12.2f} {row['ratio']:6.2f}")
    for phase, summary in result["phases"].items():
        print(f"{phase}: measured / analytic median {summary['median_ratio']:.2f} "
              f"(min {summary['min_ratio']:.2f}, max {summary['max_ratio']:.2f}, "
              f"{summary['points']} points)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--work-dir", type=Path, required=True,
                        help="where the checkpoint and profile.json go (reused if present)")
    parser.add_argument("--layers", type=int, help="shrink the model to this many layers")
    parser.add_argument("--kv-cache-gb", type=float, default=60.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args(argv)
    if not MODELS[args.model].gated_mlp:
        parser.error(f"{args.model}: the engine runs Llama-family (gated MLP) models only")
    configure_logging("warning")
    shape = MODELS[args.model]
    if args.layers:
        shape = dataclasses.replace(shape, layers=args.layers)
    model_dir = args.work_dir / f"{args.model}-{shape.layers}l"
    if not (model_dir / "model.safetensors").exists():
        write_checkpoint(shape, model_dir, args.device)
    grid = DRY_GRID if args.device == "cpu" else GRID
    engine = Engine(EngineConfig(model_dir=model_dir, device=args.device, kv_cache_gb=args.kv_cache_gb,
                                 max_num_batched_tokens=grid.max_batched_tokens))
    points = measure(engine, grid)
    profile = profile_json(points, f"{args.model}-{shape.layers}l-{args.device}", describe_machine(engine))
    (args.work_dir / "profile.json").write_text(json.dumps(profile, indent=2) + "\n", encoding="utf-8")
    result = {"gpu": args.gpu, "model": args.model, "layers": shape.layers,
              "measured_on": profile["measured_on"], **compare(points, args.gpu, shape)}
    print_table(result)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
