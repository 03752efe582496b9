"""Entry point of the engine roles (`worker`, `prefill`, `decode`): build the engine,
then serve it."""
from __future__ import annotations

import gc
import signal
import threading
from pathlib import Path

import torch

from common.config import ClusterConfig, model_dir
from common.engine.config import EngineConfig, engine_settings
from common.engine.engine import Engine
from common.engine.step_log import StepLogWriter
from common.logs import get_logger
from common.progress import heartbeat
from services.worker.role import role_named
from services.worker.service import KvEventBuffer, WorkerService

log = get_logger("worker")


def worker_device(device: str, index: int, visible_gpus: int) -> str:
    """The device worker `index` runs on. "cuda" spreads the workers over the GPUs this
    process sees, worker i on GPU i mod their count (one engine per GPU on a node);
    "cuda:N" and "cpu" are taken as given."""
    if device != "cuda" or visible_gpus == 0:
        return device  # with no GPU, the engine refuses "cuda" with a clear error
    return f"cuda:{index % visible_gpus}"


def engine_config(config: ClusterConfig, index: int) -> EngineConfig:
    """Worker `index`'s engine: every engine setting of `config`, on its own device."""
    settings = engine_settings(config) | {"device": worker_device(config.device, index, torch.cuda.device_count())}
    return EngineConfig(model_dir=model_dir(config), **settings)


def run(config: ClusterConfig, index: int, role: str = "worker") -> None:
    engine_role = role_named(role)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    if config.threads:
        torch.set_num_threads(config.threads)
    events = KvEventBuffer()
    with heartbeat(f"{role}-{index}: loading the model and building its kernels"):
        engine = Engine(engine_config(config, index), kv_events=events)
        warm_up_s = engine.warm_up()
    log.info("engine_settings", worker_id=f"{role}-{index}", warm_up_ms=round(warm_up_s * 1e3, 1),
             **engine_settings(engine.config))
    step_log = None
    if config.step_log_dir:
        path = Path(config.step_log_dir) / f"{role}-{index}.steps.jsonl"
        try:
            step_log = engine.step_observer = StepLogWriter(path)
        except OSError as error:
            raise SystemExit(f"step_log_dir: cannot write {path}: {error.strerror or error}") from None
    try:
        worker = WorkerService(config, index, engine, events, engine_role)
        # The model, the kernels and the libraries are built and stay: a full collection
        # would walk them all from inside the serving loop (76 ms once in a bench round).
        gc.freeze()
        worker.run(stop)
    finally:
        if step_log is not None:
            step_log.close()
