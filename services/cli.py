"""`svc`: the one binary. Each role and tool is a subcommand; heavy imports (torch)
happen inside the commands that need them so light roles stay light."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import click

from common.config import LOG_LEVELS, MAX_ENGINES, ClusterConfig, flag_name
from common.engine.config import EngineSettings
from common.logs import configure_logging
from common.settings import SCALARS, ConfigError, setting_types
from common.sockets import ENGINE_ROLES

MODEL_ROLES = (*ENGINE_ROLES, "tokenizer", "kvstore")  # the roles that read the checkpoint
NODE_PROFILE_TIMEOUT_S = 900.0  # `svc up`'s first measurement of a large model on a GPU takes minutes

# ---- options from the declared settings (common/settings.py) ---------------------------


def _flag_settings() -> list[dataclasses.Field]:
    """The configuration keys a flag can carry: every scalar one (the tables, api_keys and
    slo_classes, come from the TOML file or the environment)."""
    types = setting_types(ClusterConfig)
    return [spec for spec in dataclasses.fields(ClusterConfig) if types[spec.name] in SCALARS]


ROLE_SETTINGS = _flag_settings()


def _setting_option(spec: dataclasses.Field, kind: type, default=None, show_default: bool = False):
    """A click option for a declared setting of type `kind`: flag, choices and help from
    the declaration. With the default None, a flag not given is None and the config's
    other sources decide."""
    meta = spec.metadata
    if meta["switch"]:
        return click.option(flag_name(spec.name), is_flag=True, default=None, help=meta["help"])
    help_text = meta["help"]
    if not show_default and spec.default not in (None, ""):
        help_text += f" [default: {_shown(spec.default)}]"
    return click.option(flag_name(spec.name), type=click.Choice(meta["choices"]) if meta["choices"] else kind,
                        default=default, show_default=show_default, help=help_text)


def _shown(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def engine_option(name: str):
    """An offline command's option for engine setting `name`, defaulting to the declared default."""
    (spec,) = (spec for spec in dataclasses.fields(EngineSettings) if spec.name == name)
    return _setting_option(spec, setting_types(EngineSettings)[name], default=spec.default, show_default=True)


def role_options(function):
    types = setting_types(ClusterConfig)
    for spec in reversed(ROLE_SETTINGS):
        function = _setting_option(spec, types[spec.name])(function)
    return click.option("--config", "config_path", type=click.Path(path_type=Path), default=None,
                        help="TOML config file (BATON_* variables and flags override it)")(function)


def _overrides(flags: dict) -> dict:
    """The settings the flags give: None for a flag not given (a switch: not set)."""
    return {spec.name: (flags.get(spec.name) or None) if spec.metadata["switch"] else flags.get(spec.name)
            for spec in ROLE_SETTINGS}


def _as_flags(overrides: dict) -> list[str]:
    """`overrides` as the command line that gives them to a child `svc start`."""
    args = []
    for spec in ROLE_SETTINGS:
        value = overrides.get(spec.name)
        if value is not None:
            args += [flag_name(spec.name)] if spec.metadata["switch"] else [flag_name(spec.name), str(value)]
    return args


@click.group()
@click.option("--log-level", default="warning", show_default=True, type=click.Choice(LOG_LEVELS))
def main(log_level: str) -> None:
    """Baton: serve long, heavily shared prompts fast and fairly."""
    configure_logging(log_level)


@dataclasses.dataclass(frozen=True)
class OwnProcess:
    """The root context's obj when `svc` runs as its own program (run()), not inside a
    caller's process (a test's CliRunner): a command may then end the process (end_program)."""


def run() -> None:
    """The `svc` program: main() in a process of its own."""
    main(obj=OwnProcess())


def end_program(ctx: click.Context) -> None:
    """End the process now, output flushed, without the interpreter's teardown, where `svc`
    runs as its own program; a no-op inside a caller's process. For a command that ends
    holding a heap that dies with it: the teardown collects and frees it object by object
    (after a million simulated requests, over half a minute), the OS frees it at once."""
    if not isinstance(ctx.find_root().obj, OwnProcess):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


@main.group()
def model() -> None:
    """Manage model checkpoints."""


@model.command("init")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--size", type=click.Choice(["tiny", "small"]), default="tiny", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def model_init(directory: Path, size: str, seed: int) -> None:
    """Write a random test model (random weights, byte-level tokenizer) to DIRECTORY
    in Hugging Face format."""
    from common.engine.default_model import write_default_model

    try:
        path = write_default_model(directory, size=size, seed=seed)
    except FileExistsError as error:
        raise click.ClickException(str(error)) from error
    click.echo(f"wrote {size} model (seed {seed}) to {path}")


@main.command()
@click.option("--model", "model_dir", type=click.Path(path_type=Path),
              help="Hugging Face checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct)")
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
@engine_option("dtype")
@engine_option("kv_cache_gb")
@engine_option("device")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def generate(model_dir, prompt, prompt_ids, max_tokens, temperature, top_k, top_p, seed, stop,
             ignore_eos, logprobs, dtype, kv_cache_gb, device, as_json) -> None:
    """Generate a completion for one prompt, offline (no services)."""
    from common.engine.checkpoint import CheckpointError
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine, EngineConfigError
    from common.sampling_params import InvalidRequestError, SamplingParams

    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-ids")
    prompt_input = prompt if prompt is not None else _parse_ids(prompt_ids)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, stop=tuple(stop), ignore_eos=ignore_eos, logprobs=logprobs)
    try:
        engine = Engine(EngineConfig(model_dir=_checkpoint_dir(model_dir or _default_model()), dtype=dtype,
                                     kv_cache_gb=kv_cache_gb, device=device))
        [result] = engine.generate([prompt_input], params)
    except (CheckpointError, ConfigError, EngineConfigError, InvalidRequestError) as error:
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


# ---- cluster roles ---------------------------------------------------------------------

def _load_config(config_path: Path | None, flags: dict):
    from common.config import load_config

    try:
        return load_config(config_path, overrides=_overrides(flags))
    except ConfigError as error:
        raise click.ClickException(f"config: {error}") from error


def _check_bind_policy(config, role: str) -> None:
    """Refuse a non-loopback ZeroMQ bind without CURVE unless insecure, and warn on every
    insecure start. The HTTP gateway is the public door, guarded by API keys rather than
    CURVE: a public one without keys is warned of."""
    from common.logs import get_logger
    from common.sockets import check_bind_policy, is_loopback

    try:
        check_bind_policy(config)
    except ConfigError as error:
        raise click.ClickException(f"config: {error}") from error
    if config.insecure and not config.curve_enabled:
        get_logger("svc").warning("insecure", role=role, host=config.host,
                                  why="CURVE is off: any peer that reaches this role's sockets is believed")
        click.echo(f"svc: WARNING: {role} runs insecure: CURVE is off on {config.host}, so any peer that "
                   "reaches its sockets is believed", err=True)
    if role in ("tokenizer", "cluster") and not config.api_keys and not is_loopback(config.http_host):
        click.echo(f"svc: WARNING: the HTTP gateway on {config.http_host} takes requests from anyone who reaches "
                   "it: set [api_keys]", err=True)


@main.command()
@click.argument("role", type=click.Choice(["tokenizer", "router", "worker", "prefill", "decode", "kvstore"]))
@click.option("--index", type=int, default=0, show_default=True,
              help="engine number, unique across worker, prefill and decode (ports derive from it)")
@click.option("--check-config", is_flag=True, help="validate the configuration and exit")
@role_options
def start(role: str, index: int, check_config: bool, config_path: Path | None, **flags) -> None:
    """Run one role of a cluster in this process."""
    if not 0 <= index < MAX_ENGINES:
        raise click.BadParameter(f"must be in 0..{MAX_ENGINES - 1}", param_hint="--index")
    config = _load_config(config_path, flags)
    configure_logging(config.log_level)
    _check_bind_policy(config, role)
    if check_config:
        _check_role(role, config)
        click.echo(f"config ok for {role}")
        return
    if role in MODEL_ROLES:
        config = _with_checkpoint_dir(config)
    _pin(role, config.cpus)
    try:
        if role == "router":
            from services.router.main import run as run_router

            run_router(config)
        elif role in ENGINE_ROLES:
            from services.worker.main import run as run_engine

            run_engine(config, index, role)
        elif role == "kvstore":
            from services.kvstore.main import run as run_kvstore

            run_kvstore(config)
        else:
            from services.tokenizer.main import run as run_tokenizer

            run_tokenizer(config)
    except (RuntimeError, ValueError, TimeoutError) as error:
        raise click.ClickException(f"{role}: {error}") from error


def _pin(role: str, cpus: str) -> None:
    """Run this role on its cores (common/cpus.py), before it starts any thread."""
    from common.cpus import pin
    from common.logs import get_logger

    try:
        pinned = pin(cpus)
    except OSError as error:  # a CPU this process may not use
        raise click.ClickException(f"cpus: cannot run {role} on {cpus}: {error.strerror or error}") from error
    if pinned is not None:
        get_logger("svc").info("pinned", role=role, cpus=cpus)


def _check_role(role: str, config) -> None:
    """What starting the role would check first, without starting it (a GGUF file is
    checked whole but for its weights' values, and not converted)."""
    if role in MODEL_ROLES and config.model:
        from common.engine.checkpoint import CheckpointError, load_model_config
        from common.engine.gguf import check_gguf, is_gguf_path

        model = Path(config.model)
        try:
            if is_gguf_path(model) and not model.is_dir():
                check_gguf(model)
            else:
                load_model_config(model)
        except CheckpointError as error:
            raise click.ClickException(f"config: model: {error}") from error


def _checkpoint_dir(model: str | Path) -> Path:
    """The checkpoint directory of a `--model` value: a GGUF file's conversion, made on
    first use (common/engine/gguf.py), or the directory as given."""
    from common.engine.checkpoint import CheckpointError
    from common.engine.gguf import checkpoint_dir
    from common.progress import heartbeat

    def announce(path: Path, out_dir: Path) -> None:
        click.echo(f"converting {path} into {out_dir}, once ...", err=True)

    try:
        with heartbeat(f"model: reading {model}"):
            return checkpoint_dir(model, on_convert=announce)
    except CheckpointError as error:
        raise click.ClickException(f"model: {error}") from error


def _default_model() -> Path:
    """The model served when none is named (common/engine/packaged_model.py)."""
    from common.engine.checkpoint import CheckpointError
    from common.engine.packaged_model import serving_default_model

    try:
        return serving_default_model()
    except CheckpointError as error:
        raise click.ClickException(str(error)) from error


def _with_checkpoint_dir(config):
    """`config` with its `model` a checkpoint directory (the default model's when it names
    none), so that every role of a node reads the same one, and its `model_name` the GGUF
    file's name when it names one and sets no other."""
    model = Path(config.model) if config.model else _default_model()
    return dataclasses.replace(config, model=str(_checkpoint_dir(model)), model_name=_served_name(config, model))


def _served_name(config, model: Path) -> str:
    """What /v1/models calls the model: `model_name` where set, else a GGUF file's name
    (the default model's: SmolLM2-135M-Instruct), else the default setting."""
    from common.config import DEFAULT_MODEL_NAME
    from common.engine.gguf import is_gguf_path
    from common.engine.packaged_model import MODEL_NAME, packaged_model_file

    if config.model_name != DEFAULT_MODEL_NAME or model.is_dir() or not is_gguf_path(model):
        return config.model_name
    return MODEL_NAME if model == packaged_model_file() else model.stem


def _model_label(model: Path) -> str:
    """A model's name for a profile: a directory's name, a GGUF file's stem."""
    from common.engine.gguf import is_gguf_path

    return model.stem if is_gguf_path(model) and not model.is_dir() else model.name


@main.command()
@click.option("--workers", type=int, default=None, help="co-located workers  [default: 1, or 0 with --prefill]")
@click.option("--prefill", "prefill", type=int, default=0, show_default=True, help="prefill workers")
@click.option("--decode", "decode", type=int, default=0, show_default=True, help="decode workers")
@click.option("--no-kvstore", is_flag=True, help="start no KV store (by default one runs and the engines use it)")
@role_options
def up(workers: int | None, prefill: int, decode: int, no_kvstore: bool, config_path: Path | None,
       **flags) -> None:
    """Start a single-node cluster (router, KV store, engines, tokenizer) and supervise it:
    co-located workers, a disaggregated prefill and decode pool, or both."""
    import signal
    import threading

    from services.supervisor import Child, Supervisor

    if prefill < 0 or decode < 0 or (prefill == 0) != (decode == 0):
        raise click.BadParameter("give both --prefill and --decode (each at least 1), or neither",
                                 param_hint="--prefill/--decode")
    workers = (0 if prefill else 1) if workers is None else workers
    if workers < 0 or workers + prefill == 0:
        raise click.BadParameter("at least 1 worker, or a prefill and decode pool", param_hint="--workers")
    if workers + prefill + decode > MAX_ENGINES:
        raise click.BadParameter(f"at most {MAX_ENGINES} engines on one node", param_hint="--workers")
    engines = [*(("worker", i) for i in range(workers)), *(("prefill", workers + i) for i in range(prefill)),
               *(("decode", workers + prefill + i) for i in range(decode))]
    config = _load_config(config_path, flags)
    _check_bind_policy(config, "cluster")
    flags["dtype"] = _node_dtype(config)
    # The model (by default the packaged one; a GGUF file converted here, once, rather than
    # by each child) and its name, as every role is to see them.
    resolved = _with_checkpoint_dir(config)
    flags["model"], flags["model_name"] = resolved.model, resolved.model_name
    if not config.threads:  # workers split the cores but one, left to the tokenizer and router
        flags["threads"] = max(1, ((os.cpu_count() or 1) - 1) // len(engines))
    if not config.profile:  # the router prices with this node's engine, not another machine's
        flags["profile"] = str(_node_profile(config, Path(flags.get("model") or config.model), flags["dtype"],
                                             flags.get("threads") or config.threads))
    if not no_kvstore:
        flags["kvstore"] = True  # the engines write back to and fetch from the store
    base = [sys.executable, "-m", "services.cli", "start"]
    passed = _as_flags(_overrides(flags))
    if config_path is not None:
        passed += ["--config", str(config_path)]
    cpus = _cpu_plan(config, len(engines), flags.get("threads") or config.threads)
    others = ["--cpus", cpus.others] if cpus.others else []
    io = ["--io-cpus", cpus.others] if cpus.others and not config.io_cpus else []  # I/O threads off its cores
    children = [Child("router", [*base, "router", *passed, *others])]
    if not no_kvstore:  # before the engines, which connect to it
        children.append(Child("kvstore", [*base, "kvstore", *passed, *others]))
    children += [Child(f"{role}-{i}", [*base, role, "--index", str(i), *passed,
                                       *(["--cpus", engine_cpus, *io] if engine_cpus else [])])
                 for (role, i), engine_cpus in zip(engines, cpus.engines, strict=True)]
    children.append(Child("tokenizer", [*base, "tokenizer", *passed, *others]))
    supervisor = Supervisor(children)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        supervisor.start_all()
        pools = f"{workers} worker(s)" + (f", {prefill} prefill and {decode} decode" if prefill else "")
        click.echo(f"baton cluster up: {pools}\n"
                   f"  SDK      {config.sdk}\n"
                   f"  HTTP     http://{config.http_host}:{config.http_port}/v1\n"
                   f"  metrics  http://{config.http_host}:{config.http_port}/metrics (tokenizer), "
                   f"http://{config.host}:{config.router_metrics_port}/metrics (router), "
                   f"http://{config.host}:{config.worker_metrics_port(0)}/metrics ({engines[0][0]}-0, +2 per engine)\n"
                   + (f"  kvstore  {config.kvstore_control}, metrics "
                      f"http://{config.host}:{config.kvstore_metrics_port}/metrics\n" if not no_kvstore else "")
                   + f"  status   svc status --port-base {config.port_base}", )
        supervisor.watch(stop)
    except RuntimeError as error:
        raise click.ClickException(str(error)) from error
    finally:
        supervisor.stop_all()


def _cpu_plan(config, engines: int, threads: int):
    """Each engine's cores and the other roles' (common/cpus.py); none where the operator
    set `cpus` (it then applies to every role) or the cores do not go round."""
    from common.cpus import CpuPlan, plan_cpus

    if config.cpus or not threads:
        return CpuPlan(("",) * engines, "")
    plan = plan_cpus(frozenset(os.sched_getaffinity(0)), engines, threads)
    if plan.others:
        click.echo(f"cores: engines {' '.join(plan.engines)}, the other roles {plan.others}")
    return plan


def _node_dtype(config) -> str:
    """The dtype this node's engines compute in, `auto` resolved once for every role: the
    profile is keyed by it and the KV store sizes its blocks by it."""
    from common.engine.node_dtype import DtypeProbeError, node_dtype_choice

    try:
        dtype, why = node_dtype_choice(config.dtype, config.device)
    except DtypeProbeError as error:
        raise click.ClickException(str(error)) from error
    if dtype != config.dtype:
        click.echo(why)
    return dtype


def _node_profile(config, model_dir: Path, dtype: str, threads: int) -> Path:
    """The cost profile of this node's engine with the workers' settings and `dtype` (the
    resolved one): measured by `svc profile` on first use (seconds on the tiny model) and
    kept in the cache."""
    import subprocess

    from common.cache_root import baton_cache_root
    from services.eval.profiler import node_profile_path

    path = node_profile_path(baton_cache_root(), model_dir, dtype, config.device, threads)
    if path.is_file():
        click.echo(f"the router prices with this node's profile {path}")
        return path
    click.echo("measuring this node's engine for the router's cost profile, once (--profile skips it) ...")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    argv = [sys.executable, "-m", "services.cli", "profile", "--model", str(model_dir), "--dtype", dtype,
            "--device", config.device, "--threads", str(threads), "--name", path.stem, "--out", str(partial)]
    try:  # its progress lines (stderr) pass through: this can take a minute on a large model
        done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, timeout=NODE_PROFILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        partial.unlink(missing_ok=True)
        raise click.ClickException(f"measuring this node's engine took over {NODE_PROFILE_TIMEOUT_S:.0f} s; "
                                   f"give --profile (a file `svc profile` wrote, or a built-in name)") from None
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise click.ClickException("measuring this node's engine failed (its errors are above); give --profile "
                                   "to skip it")
    os.replace(partial, path)  # whole or not at all, should two starts race
    click.echo(f"wrote {path}")
    return path


@main.command()
@click.option("--timeout-s", type=float, default=3.0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@role_options
def status(timeout_s: float, as_json: bool, config_path: Path | None, **flags) -> None:
    """Show each worker's health, load and KV usage, as the router sees them."""
    import msgspec
    import zmq

    from common.protocol import Status, StatusRequest, decode
    from common.sockets import Security, send

    config = _load_config(config_path, flags)
    context = zmq.Context()
    try:
        security = Security(context, config, "tokenizer")  # the router answers tokenizers' status requests
        socket = security.client(zmq.DEALER, config.router, "router")
        send(socket, StatusRequest())
        if not socket.poll(int(timeout_s * 1000)):
            raise click.ClickException(f"router at {config.router} did not answer within {timeout_s} s")
        reply, _ = decode(socket.recv_multipart())
    except (ConfigError, ValueError) as error:
        raise click.ClickException(f"config: {error}") from error
    finally:
        context.destroy(linger=0)
    if not isinstance(reply, Status):
        raise click.ClickException(f"unexpected reply from the router: {reply}")
    if as_json:
        click.echo(msgspec.json.encode(reply).decode())
        return
    click.echo(f"router {config.router}  policy={reply.policy}  routed={reply.requests_routed}  "
               f"kv_events={reply.kv_events_received}")
    click.echo(f"{'worker':<12}{'health':<9}{'seen':>7}{'running':>9}{'waiting':>9}{'in_flight':>11}"
               f"{'kv_used':>9}{'kv_cached':>11}{'kv_total':>10}")
    for w in reply.workers:
        click.echo(f"{w.worker_id:<12}{'ok' if w.healthy else 'down':<9}{w.last_seen_s:>6.1f}s{w.running:>9}"
                   f"{w.waiting:>9}{w.in_flight:>11}{w.kv_blocks_used:>9}{w.kv_blocks_cached:>11}"
                   f"{w.kv_blocks_total:>10}")


@main.group()
def keys() -> None:
    """ZeroMQ CURVE keys."""


@keys.command("generate")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--keep", is_flag=True, help="leave a complete set already in DIRECTORY as it is")
def keys_generate(directory: Path, keep: bool) -> None:
    """Write a CURVE key pair for every role (router, worker, tokenizer, client) into
    DIRECTORY: <role>.key public, <role>.key_secret secret. Give each host the public keys
    and only its own role's secret; give SDK users client.key_secret and tokenizer.key."""
    from common.sockets import ROLES, generate_curve_keys

    if keep and all((directory / f"{role}.{suffix}").is_file() for role in ROLES for suffix in ("key", "key_secret")):
        click.echo(f"kept the keys in {directory}")
        return
    try:
        written = generate_curve_keys(directory)
    except (FileExistsError, OSError) as error:
        raise click.ClickException(str(error)) from error
    for path in written:
        click.echo(f"wrote {path}")
    click.echo(f'config:\ncurve_enabled = true\ncurve_keys_dir = "{directory.resolve()}"')


@main.command("profile")
@click.option("--model", "model_dir", type=click.Path(path_type=Path),
              help="Hugging Face checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct)")
@click.option("--out", type=click.Path(path_type=Path), help="write the profile here (default: print it)")
@click.option("--name", help="the profile's name (default: <model directory>-<device>)")
@engine_option("dtype")
@engine_option("device")
@click.option("--threads", type=int, default=0, show_default=True, help="torch threads (0 = torch's default)")
@engine_option("kv_cache_gb")
@click.option("--quick", is_flag=True, help="a small grid: seconds on the tiny model")
@click.option("--full", is_flag=True, help="a finer grid (to 2,048 tokens of context): minutes on the default model")
@click.option("--compare-preble", is_flag=True,
              help="print the analytic h100/llama-3-70b prefill against Preble's published fit; measure nothing")
def profile(model_dir, out, name, dtype, device, threads, kv_cache_gb, quick, full, compare_preble) -> None:
    """Measure this machine's engine (prefill and decode step times) and write the fitted
    cost profile as JSON, for --profile."""
    if compare_preble:
        _echo_preble_comparison()
        return
    import torch

    from common.cost_model import ProfileError
    from common.engine.checkpoint import CheckpointError
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine, EngineConfigError
    from common.progress import heartbeat
    from services.eval.profiler import FULL_GRID, GRID, QUICK_GRID, ProfilerError, run_profile

    if threads:
        torch.set_num_threads(threads)
    if quick and full:
        raise click.UsageError("give at most one of --quick and --full")
    grid = QUICK_GRID if quick else FULL_GRID if full else GRID
    model_dir = model_dir or _default_model()
    label = _model_label(model_dir)
    try:
        with heartbeat("profile: loading the model and building its kernels"):
            engine = Engine(EngineConfig(model_dir=_checkpoint_dir(model_dir),
                                         dtype=dtype, device=device, kv_cache_gb=kv_cache_gb,
                                         max_num_batched_tokens=grid.max_batched_tokens))
        data = run_profile(engine, grid, name or f"{label}-{device}")
    except (CheckpointError, ConfigError, EngineConfigError, ProfilerError, ProfileError) as error:
        raise click.ClickException(str(error)) from error
    text = json.dumps(data, indent=2)
    if out is None:
        click.echo(text)
    else:
        out.write_text(text + "\n", encoding="utf-8")
    for phase in ("prefill", "decode"):
        fit_error = data["fit"][phase]
        coefficients = ", ".join(f"{key}={value:.3g}" for key, value in data[phase].items())
        click.echo(f"{phase}: {coefficients} s; fit error mean {fit_error['mean_abs_rel_error']:.1%}, "
                   f"max {fit_error['max_abs_rel_error']:.1%} over {fit_error['points']} points",
                   err=out is None)
    if data.get("wake"):
        points = ", ".join(f"+{extra * 1000:.2f} ms after {idle:g} s idle" for idle, extra in data["wake"])
        click.echo(f"wake: {points}", err=out is None)
    if out is not None:
        click.echo(f"wrote {out}")


def _echo_preble_comparison() -> None:
    from common.profiles import PREBLE_TP, preble_comparison

    click.echo("Llama-3-70B prefill on H100: analytic roofline (and its fitted profile) vs Preble's "
               "fit 28.93 + 0.1822 n + 0.004004 ctx + 2.55e-6 n ctx ms")
    for tp in (PREBLE_TP, 8):
        click.echo(f"tp={tp}\n{'n':>6}{'ctx':>7}{'Preble ms':>11}{'roofline ms':>13}{'profile ms':>12}"
                   f"{'profile/Preble':>16}")
        for row in preble_comparison(tp):
            click.echo(f"{row['n']:>6}{row['ctx']:>7}{row['preble_s'] * 1e3:>11.1f}"
                       f"{row['roofline_s'] * 1e3:>13.1f}{row['analytic_s'] * 1e3:>12.1f}{row['ratio']:>16.2f}")


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise click.BadParameter(f"not a comma-separated list of integers: {text!r}",
                                 param_hint="--prompt-ids") from error

from services.eval.bench_command import bench  # noqa: E402 (click only; the work imports lazily)

main.add_command(bench)
from services.eval.sim_command import sim  # noqa: E402 (click only; the work imports lazily)

main.add_command(sim)
from services.eval.plan_command import plan  # noqa: E402 (click only; the work imports lazily)

main.add_command(plan)


if __name__ == "__main__":
    run()
