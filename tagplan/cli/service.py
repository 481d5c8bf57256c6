"""`tagplan serve`, `tagplan worker`, `tagplan admin create-key`, `tagplan submit`: the planning service.

`serve` runs the API with uvicorn and an embedded pool of worker processes; `--demo` (what
`make run` does) also creates a local API key (printed once, kept in `$TAGPLAN_HOME/local.key`),
submits one example plan over HTTP and prints it and where to look, then keeps serving
(`--exit-after-demo`: stops once the plan is printed, exit status 0 only if it was).
SIGTERM or SIGINT stops the server and then its workers, which hand their jobs back.

The HTTP client here is the standard library's (`urllib`): `make run` works with the run
dependencies alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tagplan.cli.demo import DEMO_BATCH, DEMO_CLUSTER, DEMO_MAX_EVALUATIONS, DEMO_MODEL, DEMO_SEQ
from tagplan.cli.options import add_cluster_options, cluster_options
from tagplan.errors import SpecError
from tagplan.frontends.cluster_spec import ClusterOptions
from tagplan.search.problem import DEFAULT_BUDGET_S, DEFAULT_GLOBAL_BATCH, DEFAULT_MAX_EVALUATIONS

LOCAL_KEY_FILE = "local.key"


def add_service_commands(sub: argparse._SubParsersAction) -> None:
    """Add `serve`, `worker`, `admin` and `submit` to the `tagplan` parser."""
    serve = sub.add_parser("serve", help="run the planning service (API + embedded workers)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--workers", type=int, default=1, help="embedded worker processes (0: run `tagplan worker`)")
    serve.add_argument("--demo", action="store_true",
                       help="create a local key, submit an example plan and print it (what `make run` does)")
    serve.add_argument("--exit-after-demo", action="store_true",
                       help="with --demo: stop once the example plan is printed (exit 1 if it was not)")
    serve.set_defaults(func=_serve)

    worker = sub.add_parser("worker", help="run one worker process against the service's database")
    worker.set_defaults(func=_worker)

    admin = sub.add_parser("admin", help="operator commands")
    what = admin.add_subparsers(dest="what", required=True)
    key = what.add_parser("create-key", help="create an API key for a tenant (printed once, stored hashed)")
    key.add_argument("--tenant", required=True)
    key.add_argument("--admin", action="store_true", help="may activate GNN versions")
    key.set_defaults(func=_create_key)
    revoke = what.add_parser("revoke-key", help="revoke an API key (it answers 401 from now on)")
    revoke.add_argument("--key", required=True, help="the key, or its first 8 characters as listed")
    revoke.set_defaults(func=_revoke_key)
    purge = what.add_parser("purge-jobs", help="delete finished jobs past TAGPLAN_JOB_RETENTION_S or beyond "
                                               "TAGPLAN_MAX_FINISHED_JOBS_PER_TENANT now (workers do it every "
                                               "TAGPLAN_PURGE_EVERY_S)")
    purge.set_defaults(func=_purge_jobs)

    submit = sub.add_parser("submit", help="submit a plan to a running service")
    submit.add_argument("--model", required=True, help=(
        "model SPEC; a graph file (.json/.yaml), a Hugging Face config.json or module.py:Name is read or "
        "traced here and sent inline (the service reads no files)"))
    submit.add_argument("--cluster", required=True, help=(
        "cluster SPEC, or a cluster file (.yaml/.json) that is sent inline; topology dumps are not accepted"))
    add_cluster_options(submit)
    submit.add_argument("--batch", type=int, default=DEFAULT_GLOBAL_BATCH)
    submit.add_argument("--seq", type=int, default=None)
    submit.add_argument("--max-evaluations", type=int, default=DEFAULT_MAX_EVALUATIONS)
    submit.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S)
    submit.add_argument("--url", default=os.environ.get("TAGPLAN_URL", "http://127.0.0.1:8000"))
    submit.add_argument("--key", default=os.environ.get("TAGPLAN_API_KEY"),
                        help="API key (default: $TAGPLAN_API_KEY, else the local key `serve --demo` made)")
    submit.add_argument("--wait", action="store_true", help="wait for the plan and print it")
    submit.add_argument("--timeout-s", type=float, default=600.0)
    submit.set_defaults(func=_submit)


def _private_files() -> None:
    from tagplan.service.settings import private_files  # pydantic-settings: imported by the service's commands only

    private_files()


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tagplan.service.app import create_app
    from tagplan.service.settings import Settings
    from tagplan.service.worker import WorkerPool

    _private_files()
    settings = Settings.from_env()
    settings.home.mkdir(mode=0o700, parents=True, exist_ok=True)
    url = f"http://{args.host}:{args.port}"
    server = _Server(uvicorn.Config(create_app(settings), host=args.host, port=args.port, log_level="warning"))
    pool = WorkerPool(settings, args.workers) if args.workers > 0 else None
    demo: dict[str, bool] = {}
    if pool is not None:
        pool.start()
    try:
        if args.demo:
            key = _local_key(settings)
            threading.Thread(target=_demo_client, args=(url, key, server if args.exit_after_demo else None, demo),
                             daemon=True).start()
        print(f"tagplan service on {url} (database {settings.database_url}; {args.workers} embedded workers)",
              file=sys.stderr)
        server.run()
    finally:
        if pool is not None:
            pool.stop()
    return 1 if args.exit_after_demo and not demo.get("ok") else 0


class _Server:
    """uvicorn's server, stopped by SIGTERM or SIGINT like uvicorn's own, but without re-raising the
    signal once it has stopped (uvicorn does, which would kill this process before its worker pool
    is stopped and leave the workers orphaned)."""

    def __init__(self, config: Any) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                handled = (signal.SIGINT, signal.SIGTERM)
                previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
                try:
                    yield
                finally:
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)

        self._server = Server(config)

    def run(self) -> None:
        """Serve until a signal or `stop()`."""
        self._server.run()

    def stop(self) -> None:
        """Ask the server to stop (from any thread)."""
        self._server.should_exit = True


def _local_key(settings: Any) -> str:
    """The local demo key: created once and kept in `$TAGPLAN_HOME/local.key` (created mode 600)."""
    path = settings.home / LOCAL_KEY_FILE
    if path.exists():
        return str(path.read_text().strip())
    from tagplan.service.db import make_engine
    from tagplan.service.keys import create_key

    key = create_key(make_engine(settings.database_url), "local", admin=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        out.write(key + "\n")
    print(f"created the local admin API key (printed once; kept in {path}):\n  {key}", file=sys.stderr)
    return key


def _demo_client(url: str, key: str, server: _Server | None, outcome: dict[str, bool]) -> None:
    """Wait for the server, submit the example plan, print the answer and where to look; then stop
    `server` if given."""
    try:
        _wait_ready(url)
        request = _plan_request({"model": DEMO_MODEL, "cluster": DEMO_CLUSTER,
                                 "workload": {"global_batch": DEMO_BATCH, "seq_len": DEMO_SEQ},
                                 "max_evaluations": DEMO_MAX_EVALUATIONS, "budget_s": 60.0})
        result, job = _submit_and_wait(url, key, request, timeout_s=600.0)
        _print_result(result)
        print(f"\nweb view: {url}/#/jobs/{job}?key={key}\nAPI docs: {url}/docs\n"
              f"submit more: tagplan submit --model llama2-7b --cluster dgx-a100-80gb:nodes=2 --wait\n"
              "stop the service with Ctrl-C", flush=True)
        outcome["ok"] = True
    except (SpecError, OSError) as err:
        print(f"tagplan demo: the example plan did not come back: {err}", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()


def _wait_ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, SpecError):
            if _call("GET", f"{url}/readyz", timeout_s=2.0)[0] == 200:
                return
        time.sleep(0.5)
    raise SpecError(f"the service at {url} did not become ready in {timeout_s:.0f} s")


def _call(method: str, url: str, *, key: str | None = None, body: Any = None,
          timeout_s: float = 30.0) -> tuple[int, Any]:
    """(status, JSON answer) of one HTTP request; OSError when the service cannot be reached."""
    headers = {"Accept": "application/json"}
    data = None
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            status, text = answer.status, answer.read()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read()
    try:
        return status, json.loads(text) if text else None
    except ValueError:
        return status, {"detail": text[:200].decode("utf-8", "replace")}


def _plan_request(fields: dict[str, Any]) -> dict[str, Any]:
    """The body of `POST /v1/plans`, checked here by the service's own model (`service.requests.PlanRequest`)."""
    from tagplan.service.requests import PlanRequest, read_request

    return read_request(PlanRequest, fields, "submit").to_request()


def _submit_and_wait(url: str, key: str, request: dict[str, Any], *, timeout_s: float) -> tuple[dict[str, Any], str]:
    from tagplan.service.vocabulary import TERMINAL, JobStatus

    status, answer = _call("POST", f"{url}/v1/plans", key=key, body=request)
    if status >= 400:
        raise SpecError(f"the service refused the plan ({status}): {_detail(answer)}")
    job = answer["id"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, state = _call("GET", f"{url}/v1/jobs/{job}", key=key)
        if state["status"] == JobStatus.SUCCEEDED:
            return _call("GET", f"{url}/v1/jobs/{job}/result", key=key)[1], job
        if state["status"] in TERMINAL:
            raise SpecError(f"job {job} {state['status']}: {state.get('error') or ''}")
        time.sleep(1.0)
    raise SpecError(f"job {job} did not finish within {timeout_s:.0f} s; see {url}/v1/jobs/{job}")


def _detail(answer: Any) -> str:
    return str(answer.get("detail", answer) if isinstance(answer, dict) else answer)[:500]


def _print_result(result: dict[str, Any]) -> None:
    """The best plan, stage by stage, and the baselines it beat."""
    best = result["best"]
    seconds = best.get("report", {}).get("iteration_time_s") or best.get("iteration_time_s")
    plan = best.get("plan", {})
    print(f"best plan: {seconds:.4g} s per iteration, {plan.get('micro_batches')} micro-batches, "
          f"{plan.get('schedule')}")
    for i, stage in enumerate(plan.get("stages", [])):
        start, end = stage["layers"]
        extras = "" if not stage.get("recompute") else (
            f", recompute {stage['recompute_layers']} layers" if stage.get("recompute_layers") else ", recompute")
        extras += f", ZeRO-{stage['zero']}" if stage.get("zero") else ""
        print(f"  stage {i}: layers {start}-{end - 1} on devices {stage['devices']} "
              f"(dp {stage['dp']} x tp {stage['tp']}){extras}")
    for name, baseline in result.get("baselines", {}).items():
        time_s = (baseline or {}).get("report", {}).get("iteration_time_s") if isinstance(baseline, dict) else None
        if time_s:
            print(f"  baseline {name}: {time_s:.4g} s ({time_s / seconds:.2f}x the best plan's time)")
    for name, reason in result.get("baseline_reasons", {}).items():
        if reason:
            print(f"  baseline {name}: {reason}")


def _worker(args: argparse.Namespace) -> int:
    from tagplan.service.settings import Settings
    from tagplan.service.worker import run_worker

    _private_files()
    run_worker(Settings.from_env())
    return 0


def _revoke_key(args: argparse.Namespace) -> int:
    from tagplan.service.db import make_engine
    from tagplan.service.keys import revoke_key
    from tagplan.service.settings import Settings

    _private_files()
    if not revoke_key(make_engine(Settings.from_env().database_url), args.key):
        raise SpecError(f"revoke-key: no valid key {args.key[:8]!r}... (unknown, ambiguous or already revoked)")
    print(f"revoked {args.key[:8]}...", file=sys.stderr)
    return 0


def _purge_jobs(args: argparse.Namespace) -> int:
    from tagplan.service.db import make_engine
    from tagplan.service.settings import Settings
    from tagplan.service.store import JobStore

    _private_files()
    settings = Settings.from_env()
    purged = JobStore(make_engine(settings.database_url), settings).purge()
    print(f"deleted {purged} finished jobs (kept: those that ended within {settings.job_retention_s / 86_400:g} "
          f"days, at most {settings.max_finished_jobs_per_tenant} per tenant)", file=sys.stderr)
    return 0


def _create_key(args: argparse.Namespace) -> int:
    from tagplan.service.db import make_engine
    from tagplan.service.keys import create_key
    from tagplan.service.settings import Settings

    _private_files()
    settings = Settings.from_env()
    settings.home.mkdir(parents=True, exist_ok=True)
    key = create_key(make_engine(settings.database_url), args.tenant, admin=args.admin)
    print(key)
    print(f"(tenant {args.tenant}{', admin' if args.admin else ''}; the key is stored hashed and shown only now)",
          file=sys.stderr)
    return 0


def inline_model(text: str, seq_len: int | None = None) -> str | dict[str, Any]:
    """What `submit` sends for `--model`: the SPEC itself, unless it names a file or a Python module
    (the service reads none): a tagplan graph file is sent as its contents; a Hugging Face config
    file or a user module (`file.py:Name`, traced here, with `seq_len`) as the `ModelGraph` JSON."""
    from tagplan.frontends.model_spec import ModelSpecKind, load_model, parse_model_spec
    from tagplan.frontends.textfile import parse_structured, read_text

    spec = parse_model_spec(text)
    if not spec.names_file:
        return text
    if spec.kind is ModelSpecKind.FILE and Path(spec.name).is_file():
        data = parse_structured(read_text(spec.name), spec.name)
        if isinstance(data, dict) and "blocks" in data:  # a tagplan graph, as written by hand or by tagplan
            return data
    return dict(load_model(text, seq_len=seq_len).model_dump(mode="json"))


def inline_cluster(text: str, options: ClusterOptions | None = None) -> str | dict[str, Any]:
    """What `submit` sends for `--cluster`: the SPEC itself when it names no file and no cluster option
    is given; a cluster file's own mapping; otherwise (a topology dump, a custom device, `--nodes`,
    `--nccl-tests` ...) the cluster built here, as a cluster document (`cluster_file.cluster_data`)."""
    from tagplan.frontends.cluster_file import cluster_data
    from tagplan.frontends.cluster_spec import ClusterOptions, load_cluster, parse_cluster_spec
    from tagplan.frontends.textfile import parse_structured, read_text

    spec = parse_cluster_spec(text)
    plain = options is None or options == ClusterOptions()
    if not spec.names_file and plain:
        return text
    path = Path(spec.path or "")
    if plain and spec.path is not None and path.suffix.lower() in (".yaml", ".yml", ".json") and path.is_file():
        data = parse_structured(read_text(path), str(path))
        if not isinstance(data, dict):
            raise SpecError(f"submit: cluster file {str(path)[:200]!r}: expected a mapping with node_groups")
        return {"name": path.stem, **data}
    return cluster_data(load_cluster(text, options))


def _named(field: str, read: Any, *args: Any) -> Any:
    """`read(*args)`, its SpecError prefixed `submit: <field>:` like the request's own checks."""
    try:
        return read(*args)
    except SpecError as err:
        message = str(err).removeprefix("submit: ")
        raise SpecError(f"submit: {field}: {message}") from None


def _submit(args: argparse.Namespace) -> int:
    workload: dict[str, Any] = {"global_batch": args.batch}
    if args.seq:
        workload["seq_len"] = args.seq
    request = _plan_request({"model": _named("model", inline_model, args.model, args.seq),
                             "cluster": _named("cluster", inline_cluster, args.cluster, cluster_options(args)),
                             "workload": workload,
                             "max_evaluations": args.max_evaluations, "budget_s": args.budget_s})
    key = args.key
    if not key:
        from tagplan.service.settings import Settings

        local = Settings.from_env().home / LOCAL_KEY_FILE
        if not local.exists():
            raise SpecError("submit: give --key (or set TAGPLAN_API_KEY); `tagplan admin create-key` makes one")
        key = local.read_text().strip()
    try:
        if not args.wait:
            status, answer = _call("POST", f"{args.url}/v1/plans", key=key, body=request)
            if status >= 400:
                raise SpecError(f"the service refused the plan ({status}): {_detail(answer)}")
            print(json.dumps(answer, indent=2))
            return 0
        result, _ = _submit_and_wait(args.url, key, request, timeout_s=args.timeout_s)
    except OSError as err:
        raise SpecError(f"submit: cannot reach the service at {args.url}: {err}") from None
    _print_result(result)
    return 0
