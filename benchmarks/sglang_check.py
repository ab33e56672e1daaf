"""Check the in-engine loader against the real SGLang package, on CPU, in its own virtual environment.

CI only ever runs ``tasks.installers.sglang_loader`` against stand-ins (tests/support/sglang_support.py).
This check installs the real ``sglang`` into a separate virtual environment and runs the adapter
against SGLang's real ``DefaultModelLoader`` and a real SGLang model class:

    python -m benchmarks.sglang_check --venv /tmp/sglang-check-venv [--sglang-version 0.5.23]

It is not part of the default test command: the install is about 11 GB and 6-10 minutes (SGLang
hard-pins a CUDA build of torch), and parts of SGLang need a GPU (docs/sglang.md,
"Checked against the real SGLang").

Outside the environment (any Python 3.11+, standard library only) it creates or reuses the
environment, ``pip install``s ``sglang==VERSION`` together with this project's own dependencies
(``[project] dependencies`` of pyproject.toml; the project itself runs from this working tree,
on ``PYTHONPATH``, so nothing is built inside the repository), checks the installed version
against the ``sglang`` extra's requirement, then runs itself inside the environment
(``--inside``). Inside, each step prints PASS, FAIL, BLOCKED or SKIP with the exception text and
where in SGLang it was raised:

- ``sglang import``: ``import sglang``, its version, torch and whether CUDA is available;
- ``adapter symbols``: every ``from sglang... import`` in the adapter (found by reading its
  source), and the attributes and signatures it relies on (``DefaultModelLoader.Source`` fields,
  ``_get_weights_iterator``, ``load_weights_and_postprocess``, ``restore_weights_before_loading``,
  ``LoadFormat.SAFETENSORS``), with file:line in SGLang;
- ``cpu engine import``: ``SGLANG_USE_CPU_ENGINE=1 python -c 'import sglang.srt.model_loader.loader'``;
- ``checkpoint``, ``store``: a tiny random Llama (bf16, two shards, a real config.json), published
  as r0 and an r1 delta, and a receiver store refitted to r1 with the project's own publish and
  refit runbooks (no Prefect server needed);
- ``engine context``: what a TP rank's scheduler process has (published ``ServerArgs`` with the
  loader registered as ``custom_weight_loader``, a world-1 gloo process group);
- ``wire``: the installer's ``/update_weights_from_tensor`` body decoded by SGLang's own
  serializer and request struct, and the ``load_format`` resolved by SGLang's ``dynamic_import``;
- ``tp rank``: the adapter's ``tp_rank()`` against SGLang's ``get_parallel().tp_rank``;
- ``weights iterator``: the adapter's ``weights()`` (the loader's own reader, once SGLang's
  ``_get_weights_iterator`` was built) over the prepared folder, byte for byte, and SGLang's iterator
  itself with the runner's ``ModelConfig`` in the ``Source``;
- ``plain module install``: ``load_prepared_checkpoint(module, [])`` into a plain torch module whose
  ``load_weights`` uses SGLang's ``default_weight_loader``;
- ``model build``: SGLang's ``get_model`` builds its ``LlamaForCausalLM`` on CPU from the launch
  snapshot; on a machine without a GPU this is BLOCKED by a GPU-only kernel import, and
  ``model build (rotary kernel stubbed)`` builds it again with only that kernel replaced by a
  stub that raises if called (weight loading never calls it);
- ``model install``: ``load_prepared_checkpoint(model, [])`` (resolved through SGLang's
  ``dynamic_import``) into the real model, then every parameter against r1 bit for bit (fused
  ``qkv_proj``/``gate_up_proj`` rebuilt from the checkpoint's q/k/v and gate/up), and the
  rank's report.

BLOCKED means the step needs a GPU: the exception is a missing GPU-only module or library (vllm's
kernels, ``libcuda.so``) on a machine where torch sees no CUDA device. Exit status: 0 if no step
FAILED (BLOCKED steps are reported; ``--strict`` counts them as failures), 1 if a step failed, 2
if the environment could not be set up. The JSON report (``--report``, default
``$OUT/sglang_check.json`` or ``{work}/sglang_check.json``) holds every step, its detail, error and
traceback.

One module of about 760 lines: a linear script of independent checks against the real package,
each a short step; splitting it would only scatter the steps.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ADAPTER = ROOT / "tasks" / "installers" / "sglang_loader.py"
WRITTEN_AGAINST = "0.5.23"  # the SGLang release the adapter was written and measured against
MODEL = "check/tiny-llama"
PASS, FAIL, BLOCKED, SKIP = "PASS", "FAIL", "BLOCKED", "SKIP"


# -- steps ----------------------------------------------------------------------------------------


class Steps:
    """Runs named steps, prints one line each, keeps the JSON-able record."""

    def __init__(self):
        self.records: list[dict] = []
        self.values: dict[str, object] = {}

    def status(self, name: str) -> str | None:
        return next((r["status"] for r in self.records if r["name"] == name), None)

    def run(self, name: str, fn, *, needs: tuple[str, ...] = (), blockable: bool = False):
        """Run ``fn() -> (value, detail)``; a missing prerequisite makes it SKIP."""
        missing = [n for n in needs if self.status(n) != PASS]
        if missing:
            return self._record(name, SKIP, 0.0, detail=f"needs {', '.join(missing)}")
        started = time.perf_counter()
        try:
            value, detail = fn()
        except Exception as exc:  # every failure is a result
            status = BLOCKED if blockable and needs_gpu(exc) else FAIL
            self._record(name, status, time.perf_counter() - started, error=f"{type(exc).__name__}: {exc}",
                         where=raised_at(exc), trace=traceback.format_exc(limit=-12))
            return None
        self.values[name] = value
        self._record(name, PASS, time.perf_counter() - started, detail=detail)
        return value

    def add(self, name: str, status: str, seconds: float = 0.0, **fields) -> None:
        self._record(name, status, seconds, **fields)

    def _record(self, name: str, status: str, seconds: float, **fields) -> None:
        record = {"name": name, "status": status, "seconds": round(seconds, 2), **fields}
        self.records.append(record)
        line = f"[{status}] {name} ({seconds:.1f}s)"
        if fields.get("detail"):
            line += f": {fields['detail']}"
        if fields.get("error"):
            line += f"\n    {fields['error']}"
        if fields.get("where"):
            line += f"\n    raised at {fields['where']}"
        print(line, flush=True)


def needs_gpu(exc: BaseException) -> bool:
    """The exception is a GPU-only import failing on a machine without CUDA."""
    try:
        import torch

        if torch.cuda.is_available():
            return False
    except Exception:
        pass
    text = f"{exc}"
    if isinstance(exc, ImportError) and (getattr(exc, "name", None) or "").split(".")[0] in {"vllm"}:
        return True
    return any(s in text for s in ("libcuda.so", "Found no NVIDIA driver", "No CUDA GPUs are available",
                                   "Torch not compiled with CUDA"))


def raised_at(exc: BaseException) -> str | None:
    """The innermost frame in SGLang (else the innermost frame) that raised ``exc``, as path:line."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if "/sglang/" in frame.filename or "/sgl_kernel/" in frame.filename:
            return f"{short(frame.filename)}:{frame.lineno} ({frame.name}: {frame.line})"
    return None  # raised by this check itself: the message says it all


def short(path: str) -> str:
    """A path relative to site-packages or the repository, when it is inside one."""
    for marker in ("/site-packages/", str(ROOT) + "/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def where_defined(obj) -> str:
    import inspect

    obj = inspect.unwrap(getattr(obj, "__func__", obj))
    try:
        return f"{short(inspect.getsourcefile(obj))}:{inspect.getsourcelines(obj)[1]}"
    except (TypeError, OSError):
        return "?"


# -- inside the environment: the checks ---------------------------------------------------------


def adapter_imports() -> list[tuple[str, str, int]]:
    """(module, name, line) of every ``from sglang... import name`` in the adapter's source."""
    out = []
    for node in ast.walk(ast.parse(ADAPTER.read_text(), str(ADAPTER))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sglang":
            out += [(node.module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            out += [(alias.name, "", node.lineno) for alias in node.names if alias.name.split(".")[0] == "sglang"]
    return out


def tiny_llama_config(shape) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": shape.vocab,
            "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
            "num_hidden_layers": shape.layers, "num_attention_heads": 4, "num_key_value_heads": 4,
            "head_dim": shape.hidden // 4, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}


def as_torch(bits):
    import numpy as np
    import torch

    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)


STACKED = ((".qkv_proj", ".q_proj", 0), (".qkv_proj", ".k_proj", 1), (".qkv_proj", ".v_proj", 2),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))


def fused(tensors: dict) -> dict:
    """Checkpoint tensors as SGLang's Llama holds them at TP 1: q/k/v and gate/up concatenated."""
    import torch

    out, groups = {}, {}
    for name, tensor in tensors.items():
        for param, shard, index in STACKED:
            if shard in name:
                groups.setdefault(name.replace(shard, param), {})[index] = tensor
                break
        else:
            out[name] = tensor
    for name, parts in groups.items():
        out[name] = torch.cat([parts[i] for i in sorted(parts)], dim=0)
    return out


def compare(params: dict, want: dict) -> list[str]:
    """Names whose parameter differs from ``want`` bit for bit (or is missing on either side)."""
    import torch

    bad = sorted(set(params) ^ set(want))
    for name in sorted(set(params) & set(want)):
        got, exp = params[name].detach(), want[name]
        if got.shape != exp.shape or got.dtype != exp.dtype or not torch.equal(got.view(torch.int16),
                                                                              exp.view(torch.int16)):
            bad.append(name)
    return bad


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inside(args) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect"))
    steps = Steps()
    info: dict = {"python": sys.version.split()[0], "executable": sys.executable}

    # 1. SGLang itself
    def import_sglang():
        import sglang
        import torch

        info.update(sglang=sglang.__version__, sglang_file=short(sglang.__file__), torch=torch.__version__,
                    cuda_available=torch.cuda.is_available())
        return sglang, (f"sglang {sglang.__version__} (written against {WRITTEN_AGAINST}), torch {torch.__version__}, "
                        f"CUDA available: {torch.cuda.is_available()}")

    steps.run("sglang import", import_sglang)

    # 2. every SGLang symbol the adapter uses
    def symbols():
        import dataclasses
        import importlib
        import inspect

        found, problems = {}, []
        for module, name, line in adapter_imports():
            label = f"from {module} import {name}" if name else f"import {module}"
            try:
                mod = importlib.import_module(module)
                if name and not hasattr(mod, name):
                    # what `from module import name` does, with its exact message
                    exec(f"from {module} import {name}", {})
                found[label] = where_defined(getattr(mod, name)) if name else short(mod.__file__)
            except Exception as exc:
                problems.append(f"{label} (tasks/installers/sglang_loader.py:{line}) fails: "
                                f"{type(exc).__name__}: {exc}{not_exported(module, name)}")
        from sglang.srt.configs.load_config import LoadConfig, LoadFormat
        from sglang.srt.model_loader.loader import DefaultModelLoader as D

        checks = {
            "LoadFormat.SAFETENSORS": lambda: LoadFormat.SAFETENSORS,
            "LoadConfig(load_format=...)": lambda: inspect.signature(LoadConfig).bind(
                load_format=LoadFormat.SAFETENSORS),
            "DefaultModelLoader.Source fields": lambda: _require(
                {f.name for f in dataclasses.fields(D.Source)},
                {"model_or_path", "revision", "prefix", "fall_back_to_pt", "allow_patterns_overrides", "model_config"}),
            "DefaultModelLoader._get_weights_iterator(source)": lambda: inspect.signature(
                D._get_weights_iterator).bind(object(), object()),
            "DefaultModelLoader.load_weights_and_postprocess (static, model, weights, target_device)": lambda: (
                _static(D, "load_weights_and_postprocess"),
                inspect.signature(D.load_weights_and_postprocess).bind(object(), object(), object())),
            "DefaultModelLoader.restore_weights_before_loading (static, model, target_device)": lambda: (
                _static(D, "restore_weights_before_loading"),
                inspect.signature(D.restore_weights_before_loading).bind(object(), object())),
        }
        where = {"LoadFormat.SAFETENSORS": LoadFormat, "LoadConfig(load_format=...)": LoadConfig,
                 "DefaultModelLoader.Source fields": D.Source}
        for label, check in checks.items():
            try:
                check()
                attr = label.split(" ")[0].split("(")[0].split(".")[-1]
                found[label] = where_defined(where.get(label) or getattr(D, attr))
            except Exception as exc:
                problems.append(f"{label}: {type(exc).__name__}: {exc}")
        info["symbols"] = found
        if problems:
            raise ImportError("; ".join(problems))
        return found, f"{len(found)} symbols and signatures as the adapter expects"

    steps.run("adapter symbols", symbols, needs=("sglang import",))

    # 3. SGLang's CPU engine switch (where the CPU build of sgl-kernel would be needed)
    def cpu_engine_import():
        env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
        done = subprocess.run([sys.executable, "-W", "ignore", "-c", "import sglang.srt.model_loader.loader"],
                              env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
            chain = [f"{short(f)}:{n}" for f, n in re.findall(r'File "([^"]+)", line (\d+)', done.stderr)
                     if "/sglang/" in f or "/sgl_kernel/" in f]
            causes = [line.lstrip("- ") for line in lines if "libcuda" in line or "No module named" in line]
            last = next((line for line in reversed(lines) if re.match(r"^\w+(Error|Exception)\b", line)), lines[-1])
            shown = chain if len(chain) <= 6 else chain[:2] + ["..."] + chain[-4:]
            raise ImportError(f"sgl_kernel cannot load: {'; '.join(causes) or last} -- import chain: "
                              f"{' -> '.join(shown)}")
        return None, "imports"

    steps.run("cpu engine import (SGLANG_USE_CPU_ENGINE=1)", cpu_engine_import, needs=("sglang import",),
              blockable=True)

    # 4. a tiny real Llama checkpoint, published and prepared by the project's own runbooks
    def checkpoint():
        from flows.synthetic import ModelShape, random_model, train_step, write_checkpoint

        shape = ModelShape(vocab=512, hidden=64, intermediate=160, layers=2, shards=2)
        r0 = random_model(shape, seed=7)
        r1 = train_step(r0, seed=8)
        config = tiny_llama_config(shape)
        write_checkpoint(work / "launch", r0, shards=shape.shards, config=config)
        write_checkpoint(work / "step1", r1, shards=shape.shards, config=config)
        changed = sum(r0[n].tobytes() != r1[n].tobytes() for n in r0)
        return {"shape": shape, "r0": r0, "r1": r1}, (f"{len(r0)} tensors, {shape.nbytes:,} bytes, 2 shards; "
                                                      f"r1 changes {changed} of them")

    steps.run("checkpoint", checkpoint)

    def store():
        from flows.publish import run_publish
        from flows.refit import run_refit
        from storage.store.local_store import LocalStore
        from storage.settings import InstallerSettings, PublishParams, RefitParams

        catalog = work / "catalog"
        for kind, folder in (("initial", work / "launch"), ("delta", work / "step1")):
            run_publish(PublishParams(catalog=str(catalog), model=MODEL, checkpoint=folder, kind=kind,
                                      state_dir=work / "publisher", emit_event=False))
        result = run_refit(RefitParams(catalog=str(catalog), model=MODEL, seed_checkpoint=str(work / "launch"),
                                       cache_dir=work / "cache", installer=InstallerSettings(kind="none"),
                                       target="r1", apply_workers=2, lock_timeout_s=30))
        st = LocalStore(work / "cache", MODEL)
        current = st.current()
        if current is None or current.version != "r1":
            raise RuntimeError(f"the refit did not prepare r1: {result.status} {result.error}")
        return st, f"receiver store {st.root} READY at r1 ({current.path}); refit {result.status}"

    steps.run("store", store, needs=("checkpoint",))

    # 5. what a TP rank's scheduler process has when SGLang calls the loader
    def engine_context():
        from sglang.srt.runtime_context import SpawnRanks, get_model, get_parallel, publish
        from sglang.srt.server_args import ServerArgs
        from tasks.installers.sglang_loader import LOADER_PATH

        server_args = ServerArgs(model_path=str(work / "launch"), device="cpu", load_format="safetensors",
                                 dtype="bfloat16", skip_tokenizer_init=True, custom_weight_loader=[LOADER_PATH])
        publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0))
        from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

        port = free_port()
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(backend="gloo")
        loaders = list(get_model().custom_weight_loader or [])
        if LOADER_PATH not in loaders:
            raise RuntimeError(f"custom_weight_loader is {loaders!r} after publishing ServerArgs")
        return server_args, (f"ServerArgs published (role scheduler, custom_weight_loader {loaders}), "
                             f"gloo world of 1, tp_rank {get_parallel().tp_rank}")

    steps.run("engine context", engine_context, needs=("sglang import", "checkpoint"))

    # 6. the installer's request, as SGLang decodes it
    def wire():
        from types import SimpleNamespace

        import msgspec
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils.common import (MultiprocessingSerializer, dynamic_import,
                                             normalize_serialized_named_tensor_payload)
        from storage.settings import InstallerSettings
        from tasks.installers.sglang import SGLangInstaller
        from tasks.installers.sglang_loader import load_prepared_checkpoint

        sent = []
        engine = SimpleNamespace(call=lambda method, path, body: sent.append((method, path, body)))
        SGLangInstaller._update(SimpleNamespace(settings=InstallerSettings(kind="none")), (engine, (2, 2)))
        (method, path, body), = sent
        fields = {f.name for f in msgspec.structs.fields(UpdateWeightsFromTensorReqInput)}
        unknown = sorted(set(body) - fields)
        if unknown:
            raise ValueError(f"{path} body fields {unknown} are not in UpdateWeightsFromTensorReqInput "
                             f"({where_defined(UpdateWeightsFromTensorReqInput)}): {sorted(fields)}")
        decoded = [MultiprocessingSerializer.deserialize(normalize_serialized_named_tensor_payload(entry))
                   for entry in body["serialized_named_tensors"]]
        if decoded != [[], []]:
            raise ValueError(f"SGLang decodes the per-rank payloads as {decoded!r}, not empty lists")
        hook = dynamic_import(body["load_format"])
        if hook is not load_prepared_checkpoint:
            raise ValueError(f"dynamic_import({body['load_format']!r}) is {hook!r}")
        import inspect

        from sglang.srt.model_executor.model_runner_components import weight_updater

        source = inspect.getsource(weight_updater).splitlines()
        call = [i for i, line in enumerate(source, 1) if re.search(r"dynamic_import\(load_format\)", line)]
        if not call or not any("custom_weight_loaders" in source[i - 3] + source[i - 2] for i in call):
            raise ValueError(f"{short(weight_updater.__file__)} no longer calls dynamic_import(load_format) for "
                             "a registered custom_weight_loader")
        return hook, (f"{method} {path} body fits UpdateWeightsFromTensorReqInput; each rank's payload "
                      f"decodes to []; dynamic_import({body['load_format']}) is the loader; SGLang calls it at "
                      f"{short(weight_updater.__file__)}:{call[0]}")

    steps.run("wire", wire, needs=("sglang import",))

    # 7. the rank the adapter reports
    def tp_rank():
        from sglang.srt.runtime_context import get_parallel
        from tasks.installers.sglang_loader import SGLangDefaultLoader

        got, want = SGLangDefaultLoader.tp_rank(), get_parallel().tp_rank
        if got != want:
            try:
                from sglang.srt.distributed import get_tensor_model_parallel_rank  # noqa: F401
                why = "?"
            except ImportError as exc:
                why = f"{type(exc).__name__}: {exc}"
            raise ValueError(f"SGLangDefaultLoader.tp_rank() is {got!r}, SGLang's get_parallel().tp_rank is "
                             f"{want!r} (the adapter's import: {why})")
        return got, f"tp_rank {got}"

    steps.run("tp rank", tp_rank, needs=("engine context",))

    # 8. SGLang's iterator over the prepared folder, through the adapter
    def weights_iterator():
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_loader.loader import DefaultModelLoader
        from tasks.installers.sglang_loader import SGLangDefaultLoader

        st = steps.values["store"]
        folder = st.absolute(st.current().path)
        want = {n: as_torch(b) for n, b in steps.values["checkpoint"]["r1"].items()}
        adapter = SGLangDefaultLoader()
        got = dict(adapter.weights(object(), folder))
        bad = compare(got, want)
        if bad:
            raise ValueError(f"the adapter's iterator over {folder} differs from r1 in {bad[:5]}")
        config = ModelConfig.from_server_args(steps.values["engine context"], model_path=str(work / "launch"))
        source = DefaultModelLoader.Source(model_or_path=str(folder), revision=None, prefix="",
                                           fall_back_to_pt=False, model_config=config)
        bad = compare(dict(adapter._loader._get_weights_iterator(source)), want)
        if bad:
            raise ValueError(f"with the runner's ModelConfig in the Source, the iterator differs in {bad[:5]}")
        return None, (f"{len(got)} tensors of {short(str(folder))} equal r1 (load_format "
                      f"{adapter._loader.load_config.load_format.value}; also with a ModelConfig in the Source)")

    steps.run("weights iterator", weights_iterator, needs=("store", "engine context"))

    # 9. the whole hook, into a plain torch module whose load_weights uses SGLang's weight loader
    def install(model, params: dict, want: dict, before: dict) -> str:
        from sglang.srt.utils.common import dynamic_import
        from tasks.installers.sglang_loader import LOADER_PATH, LoadRequest, OK, read_reports, write_request
        from storage.store.local_store import now_ms
        import uuid

        st = steps.values["store"]
        current = st.current()
        request = LoadRequest(request_id=uuid.uuid4().hex, model=st.model, version=current.version,
                              digest=current.target_digest, format_digest=current.format_digest, path=current.path,
                              files=current.files, installer="sglang_check", created_at_unix_ms=now_ms(),
                              deadline_unix_ms=now_ms() + 120_000)
        write_request(st, request)
        os.environ.update(CANONICAL_REFIT_CACHE_DIR=str(work / "cache"), CANONICAL_REFIT_MODEL=MODEL)
        unchanged = [n for n in want if n in before and compare({n: before[n]}, {n: want[n]}) == []]
        returned = dynamic_import(LOADER_PATH)(model, [])  # as SGLang's weight updater calls it
        reports = read_reports(st, request.request_id)
        if returned is not None or len(reports) != 1:
            raise RuntimeError(f"the hook returned {returned!r} and wrote {len(reports)} reports")
        report = reports[0]
        if report.status != OK:
            raise RuntimeError(f"the rank's report says {report.status} at {report.stage}: {report.message}")
        bad = compare(params(), want)
        if bad:
            raise ValueError(f"after the install {len(bad)} parameters differ from r1: {bad[:6]}")
        return (f"report ok ({report.tensors} tensors, {report.bytes:,} bytes, tp_rank {report.tp_rank}, "
                f"{report.seconds}s); all {len(want)} parameters equal r1 bit for bit "
                f"({len(want) - len(unchanged)} changed from r0)")

    def plain_module():
        import torch
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        ck = steps.values["checkpoint"]

        class Plain(torch.nn.Module):
            def __init__(self, tensors):
                super().__init__()
                self.names = sorted(tensors)
                for name in self.names:
                    self.register_parameter(name.replace(".", "__"), torch.nn.Parameter(
                        as_torch(tensors[name]), requires_grad=False))

            def load_weights(self, weights):
                for name, tensor in weights:
                    param = getattr(self, name.replace(".", "__"))
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)

        module = Plain(ck["r0"])
        params = lambda: {n: getattr(module, n.replace(".", "__")) for n in module.names}  # noqa: E731
        before = {n: p.detach().clone() for n, p in params().items()}
        return None, install(module, params, {n: as_torch(b) for n, b in ck["r1"].items()}, before)

    steps.run("plain module install", plain_module, needs=("store", "engine context"))

    # 10. SGLang's own LlamaForCausalLM, built by SGLang's get_model on CPU
    def build_model():
        import torch
        from sglang.srt.configs.device_config import DeviceConfig
        from sglang.srt.configs.load_config import LoadConfig, LoadFormat
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_loader import get_model

        config = ModelConfig.from_server_args(steps.values["engine context"])
        model = get_model(model_config=config, load_config=LoadConfig(load_format=LoadFormat.SAFETENSORS),
                          device_config=DeviceConfig("cpu"))
        params = dict(model.named_parameters())
        bad = compare(params, fused({n: as_torch(b) for n, b in steps.values["checkpoint"]["r0"].items()}))
        if bad:
            raise ValueError(f"{type(model).__name__} built from the launch snapshot differs from r0 in {bad[:6]}")
        device = next(iter(params.values())).device
        return model, (f"{type(model).__module__}.{type(model).__name__} ({where_defined(type(model))}), "
                       f"{len(params)} parameters on {device}, equal to r0 (launch snapshot)")

    model = steps.run("model build", build_model, needs=("engine context",), blockable=True)
    if model is None and steps.status("model build") == BLOCKED:
        def build_stubbed():
            import types

            def rotary_embedding(*_, **__):
                raise RuntimeError("sglang_check stub: vllm's rotary kernel is not available on this machine")

            vllm, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")
            ops.rotary_embedding, vllm._custom_ops = rotary_embedding, ops
            sys.modules.setdefault("vllm", vllm)
            sys.modules.setdefault("vllm._custom_ops", ops)
            built, detail = build_model()
            return built, detail + "; only vllm._custom_ops.rotary_embedding (forward only) is a stub"

        model = steps.run("model build (rotary kernel stubbed)", build_stubbed, needs=("engine context",))
    built_by = "model build" if steps.status("model build") == PASS else "model build (rotary kernel stubbed)"

    def model_install():
        want = fused({n: as_torch(b) for n, b in steps.values["checkpoint"]["r1"].items()})
        params = lambda: dict(model.named_parameters())  # noqa: E731
        before = {n: p.detach().clone() for n, p in params().items()}
        return None, install(model, params, want, before)

    steps.run("model install", model_install, needs=("store", built_by))

    failed = [r["name"] for r in steps.records if r["status"] == FAIL]
    blocked = [r["name"] for r in steps.records if r["status"] == BLOCKED]
    report = {"sglang_version": info.get("sglang"), "written_against": WRITTEN_AGAINST, "info": info,
              "steps": steps.records, "failed": failed, "blocked": blocked}
    Path(args.inside_report).write_text(json.dumps(report, indent=2, default=str))
    return 1 if failed else 0


def not_exported(package: str, name: str) -> str:
    """Where ``name`` lives in ``package``'s submodules when the package does not export it."""
    import inspect

    for module_name, module in sorted(sys.modules.items()):
        if not module_name.startswith(package + ".") or not hasattr(module, name) or module is None:
            continue
        text = f"; it is defined at {where_defined(getattr(module, name))}"
        try:
            source = inspect.getsource(module).splitlines()
        except (OSError, TypeError):
            return text
        public = getattr(module, "__all__", None)
        if public is not None and name not in public:
            line = next((i for i, l in enumerate(source, 1) if l.startswith("__all__")), "?")
            mention = next((i for i, l in enumerate(source, 1) if f'"{name}"' in l), None)
            text += (f" but {module_name}.__all__ ({short(module.__file__)}:{line}) leaves it out, so "
                     f"`from {package} import *` does not re-export it")
            if mention:
                text += f" (named at {short(module.__file__)}:{mention}: {source[mention - 1].strip()})"
        return text
    return ""


def _require(have: set, want: set):
    if not want <= have:
        raise TypeError(f"missing {sorted(want - have)}; has {sorted(have)}")


def _static(cls, name: str):
    import inspect

    if not isinstance(inspect.getattr_static(cls, name), staticmethod):
        raise TypeError(f"{cls.__name__}.{name} is no longer a staticmethod")


# -- outside: the environment --------------------------------------------------------------------


def project_requirements() -> tuple[list[str], list[str]]:
    """(``[project] dependencies``, the ``sglang`` extra) of pyproject.toml."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"]), list(project["optional-dependencies"]["sglang"])


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def installed_version(python: Path, dist: str) -> str | None:
    done = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                          capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def outside(args) -> int:
    venv, work = Path(args.venv).resolve(), Path(args.work or tempfile.mkdtemp(prefix="sglang-check-"))
    work.mkdir(parents=True, exist_ok=True)
    report_path = Path(args.report or Path(os.environ.get("OUT") or work) / "sglang_check.json")
    report_path.parent.mkdir(parents=True, exist_ok=True)
    steps = Steps()
    deps, extra = project_requirements()
    wanted = extra if args.sglang_version == "extra" else [f"sglang=={args.sglang_version}"]
    summary: dict = {"command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.sglang_check"]
                                         + sys.argv[1:]),
                     "venv": str(venv), "work": str(work), "requested": wanted, "extra": extra,
                     "written_against": WRITTEN_AGAINST}
    python = venv_python(venv)

    def make_venv():
        if python.exists():
            return "reused", f"reusing {venv}"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        return "created", f"created {venv} with {sys.executable}"

    steps.run("venv", make_venv)

    def install():
        log = work / "pip.log"
        command = [str(python), "-m", "pip", "install", "--progress-bar", "off", *wanted, *deps]
        started = time.perf_counter()
        with open(log, "w") as fh:
            done = subprocess.run(command, stdout=fh, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            tail = log.read_text().strip().splitlines()[-15:]
            raise RuntimeError(f"pip exited {done.returncode} (log {log}):\n      " + "\n      ".join(tail))
        version = installed_version(python, "sglang")
        summary["pip"] = {"command": " ".join(command[1:]), "log": str(log),
                          "seconds": round(time.perf_counter() - started, 1)}
        return version, f"sglang {version}, torch {installed_version(python, 'torch')} (pip log {log})"

    if args.no_install:
        version = installed_version(python, "sglang") if python.exists() else None
        steps.add("pip install", PASS if version else FAIL, detail=f"--no-install: sglang {version} already there"
                  if version else None, error=None if version else f"--no-install, and {venv} has no sglang")
        steps.values["pip install"] = version
    else:
        steps.run("pip install", install, needs=("venv",))

    def extra_satisfied():
        version = steps.values["pip install"]
        code = ("import sys; from packaging.requirements import Requirement; r = Requirement(sys.argv[1]); "
                "print(r.specifier.contains(sys.argv[2], prereleases=True))")
        done = subprocess.run([str(python), "-c", code, extra[0], version], capture_output=True, text=True)
        if done.stdout.strip() != "True":
            raise RuntimeError(f"sglang {version} does not satisfy the project's extra {extra[0]!r} "
                               f"{done.stderr.strip()[-300:]}")
        return None, f"sglang {version} satisfies the `sglang` extra ({extra[0]})"

    steps.run("extra requirement", extra_satisfied, needs=("pip install",))

    inner_report = work / "inside.json"
    status = 2
    if steps.status("extra requirement") == PASS or (args.no_install and steps.status("pip install") == PASS):
        env = dict(os.environ, PYTHONPATH=str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"]
                                                       if os.environ.get("PYTHONPATH") else ""),
                   PYTHONUNBUFFERED="1", PREFECT_HOME=str(work / "prefect"), DO_NOT_TRACK="1",
                   PREFECT_SERVER_ANALYTICS_ENABLED="false", TOKENIZERS_PARALLELISM="false")
        for name in ("CANONICAL_REFIT_CACHE_DIR", "CANONICAL_REFIT_MODEL", "SGLANG_USE_CPU_ENGINE", "PREFECT_API_URL"):
            env.pop(name, None)
        print(f"--- inside {venv} (cwd {ROOT}) ---", flush=True)
        try:
            done = subprocess.run([str(python), "-m", "benchmarks.sglang_check", "--inside", "--work",
                                   str(work / "inside"), "--inside-report", str(inner_report)],
                                  cwd=ROOT, env=env, timeout=args.timeout)
            rc = done.returncode
        except subprocess.TimeoutExpired:
            rc = None
        if inner_report.exists():
            inner = json.loads(inner_report.read_text())
            summary.update({k: v for k, v in inner.items() if k != "steps"})
            steps.records += inner["steps"]
            status = 1 if inner["failed"] or (args.strict and inner["blocked"]) else 0
        else:
            steps.add("inside", FAIL, error=f"the check inside the environment exited {rc} "
                      f"({'timed out after %ss' % args.timeout if rc is None else 'without a report'})")
            status = 1
    counts = {s: sum(r["status"] == s for r in steps.records) for s in (PASS, FAIL, BLOCKED, SKIP)}
    summary.update(passed=status == 0, exit_status=status, counts=counts, steps=steps.records)
    report_path.write_text(json.dumps(summary, indent=2, default=str))
    print(f"--- sglang {summary.get('sglang_version')}: " + ", ".join(f"{n} {s}" for s, n in counts.items())
          + f"; exit {status}; report {report_path}", flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--venv", help="virtual environment to create or reuse (outside the repository, "
                                       "e.g. /tmp/sglang-check-venv)")
    parser.add_argument("--sglang-version", default=WRITTEN_AGAINST,
                        help=f"sglang release to install (default {WRITTEN_AGAINST}, the one the adapter was "
                             "written against); 'extra' installs the pyproject extra's requirement as is")
    parser.add_argument("--work", help="scratch folder (default: a new temp dir)")
    parser.add_argument("--report", help="JSON report (default $OUT/sglang_check.json, else {work}/sglang_check.json)")
    parser.add_argument("--no-install", action="store_true", help="use the environment as it is (no pip)")
    parser.add_argument("--strict", action="store_true", help="count BLOCKED (needs a GPU) steps as failures")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the checks inside (default 1800)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--inside-report", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        return inside(args)
    if not args.venv:
        parser.error("--venv DIR is required")
    if Path(args.venv).resolve().is_relative_to(ROOT):
        parser.error(f"--venv must be outside the repository ({ROOT})")
    return outside(args)


if __name__ == "__main__":
    sys.exit(main())
