"""`svc`: the one binary. Each role and tool is a subcommand; heavy imports (torch)
happen inside the commands that need them so light roles stay light."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from common.logs import configure_logging


@click.group()
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def main(log_level: str) -> None:
    """Baton: serve long, heavily shared prompts fast and fairly."""
    configure_logging(log_level)


@main.group()
def model() -> None:
    """Manage model checkpoints."""


@model.command("init")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--size", type=click.Choice(["tiny", "small"]), default="tiny", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def model_init(directory: Path, size: str, seed: int) -> None:
    """Write the embedded default model (random weights, byte-level tokenizer) to DIRECTORY
    in Hugging Face format."""
    from common.engine.default_model import write_default_model

    try:
        path = write_default_model(directory, size=size, seed=seed)
    except FileExistsError as error:
        raise click.ClickException(str(error)) from error
    click.echo(f"wrote {size} model (seed {seed}) to {path}")


@main.command()
@click.option("--model", "model_dir", type=click.Path(path_type=Path),
              help="Hugging Face checkpoint directory (default: the tiny embedded model)")
@click.option("--prompt", help="prompt text")
@click.option("--prompt-ids", help="prompt token ids, comma separated")
@click.option("--max-tokens", type=int, default=32, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy")
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--ignore-eos", is_flag=True)
@click.option("--logprobs", type=int, default=None)
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option("--kv-cache-gb", type=float, default=1.0, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def generate(model_dir, prompt, prompt_ids, max_tokens, temperature, top_k, top_p, seed, stop,
             ignore_eos, logprobs, dtype, kv_cache_gb, device, as_json) -> None:
    """Generate a completion for one prompt, offline (no services)."""
    from common.engine.checkpoint import CheckpointError
    from common.engine.config import EngineConfig
    from common.engine.default_model import default_model_dir
    from common.engine.engine import Engine, EngineConfigError
    from common.sampling_params import InvalidRequestError, SamplingParams

    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-ids")
    prompt_input = prompt if prompt is not None else _parse_ids(prompt_ids)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, stop=tuple(stop), ignore_eos=ignore_eos, logprobs=logprobs)
    try:
        engine = Engine(EngineConfig(model_dir=model_dir or default_model_dir(), dtype=dtype,
                                     kv_cache_gb=kv_cache_gb, device=device))
        [result] = engine.generate([prompt_input], params)
    except (CheckpointError, EngineConfigError, InvalidRequestError) as error:
        raise click.ClickException(str(error)) from error
    if as_json:
        click.echo(json.dumps({
            "token_ids": result.token_ids, "text": result.text,
            "finish_reason": result.finish_reason, "prompt_token_ids": result.prompt_token_ids,
            "num_cached_tokens": result.num_cached_tokens, "ttft_s": result.ttft_s,
            "e2e_s": result.e2e_s, "logprobs": result.logprobs,
        }, ensure_ascii=False))
    else:
        click.echo(result.text)
        click.echo(f"[{len(result.token_ids)} tokens, finish_reason={result.finish_reason}, "
                   f"ttft={result.ttft_s * 1000:.1f} ms, total={result.e2e_s * 1000:.1f} ms]",
                   err=True)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise click.BadParameter(f"not a comma-separated list of integers: {text!r}",
                                 param_hint="--prompt-ids") from error


if __name__ == "__main__":
    sys.exit(main())
