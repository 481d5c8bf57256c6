"""`tagplan serve`, `tagplan worker`, `tagplan admin create-key`, `tagplan submit`: the planning service.

`serve` runs the API with uvicorn and an embedded pool of worker processes; `--demo` (what
`make run` does) also creates a local API key (printed once, kept in `$TAGPLAN_HOME/local.key`),
submits one example plan over HTTP and prints it and where to look, then keeps serving.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

from tagplan.cli.demo import DEMO_BATCH, DEMO_CLUSTER, DEMO_MAX_EVALUATIONS, DEMO_MODEL, DEMO_SEQ
from tagplan.errors import SpecError
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
    serve.set_defaults(func=_serve)

    worker = sub.add_parser("worker", help="run one worker process against the service's database")
    worker.set_defaults(func=_worker)

    admin = sub.add_parser("admin", help="operator commands")
    what = admin.add_subparsers(dest="what", required=True)
    key = what.add_parser("create-key", help="create an API key for a tenant (printed once, stored hashed)")
    key.add_argument("--tenant", required=True)
    key.add_argument("--admin", action="store_true", help="may activate GNN versions")
    key.set_defaults(func=_create_key)

    submit = sub.add_parser("submit", help="submit a plan to a running service")
    submit.add_argument("--model", required=True, help="model SPEC")
    submit.add_argument("--cluster", required=True, help="cluster SPEC")
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


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tagplan.service.app import create_app
    from tagplan.service.settings import Settings
    from tagplan.service.worker import WorkerPool

    settings = Settings.from_env()
    settings.home.mkdir(parents=True, exist_ok=True)
    pool = WorkerPool(settings, args.workers) if args.workers > 0 else None
    url = f"http://{args.host}:{args.port}"
    if pool is not None:
        pool.start()
    if args.demo:
        key = _local_key(settings)
        threading.Thread(target=_demo_client, args=(url, key), daemon=True).start()
    print(f"tagplan service on {url} (database {settings.database_url}; {args.workers} embedded workers)",
          file=sys.stderr)
    try:
        uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="warning")
    finally:
        if pool is not None:
            pool.stop()
    return 0


def _local_key(settings: Any) -> str:
    """The local demo key: created once and kept in `$TAGPLAN_HOME/local.key` (mode 600)."""
    path = settings.home / LOCAL_KEY_FILE
    if path.exists():
        return path.read_text().strip()
    from tagplan.service.db import make_engine
    from tagplan.service.keys import create_key

    key = create_key(make_engine(settings.database_url), "local", admin=True)
    path.write_text(key + "\n")
    path.chmod(0o600)
    print(f"created the local admin API key (printed once; kept in {path}):\n  {key}", file=sys.stderr)
    return key


def _demo_client(url: str, key: str) -> None:
    """Wait for the server, submit the example plan, print the answer and where to look."""
    import httpx

    for _ in range(120):
        try:
            if httpx.get(f"{url}/readyz", timeout=2.0).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    try:
        request = _plan_request({"model": DEMO_MODEL, "cluster": DEMO_CLUSTER,
                                 "workload": {"global_batch": DEMO_BATCH, "seq_len": DEMO_SEQ},
                                 "max_evaluations": DEMO_MAX_EVALUATIONS, "budget_s": 60.0})
        result, job = _submit_and_wait(url, key, request, timeout_s=600.0)
    except (SpecError, httpx.HTTPError) as err:
        print(f"tagplan demo: the example plan did not come back: {err}", file=sys.stderr)
        return
    _print_result(result)
    print(f"\nweb view: {url}/#/jobs/{job}?key={key}\nAPI docs: {url}/docs\n"
          f"submit more: tagplan submit --model llama2-7b --cluster dgx-a100-80gb:nodes=2 --wait\n"
          "stop the service with Ctrl-C", flush=True)


def _plan_request(fields: dict[str, Any]) -> dict[str, Any]:
    """The body of `POST /v1/plans`, checked here by the service's own model (`service.requests.PlanRequest`)."""
    from tagplan.service.requests import PlanRequest, read_request

    return read_request(PlanRequest, fields, "submit").to_request()


def _submit_and_wait(url: str, key: str, request: dict[str, Any], *, timeout_s: float) -> tuple[dict[str, Any], str]:
    import httpx

    from tagplan.service.vocabulary import TERMINAL, JobStatus

    headers = {"Authorization": f"Bearer {key}"}
    answer = httpx.post(f"{url}/v1/plans", json=request, headers=headers, timeout=30.0)
    if answer.status_code >= 400:
        raise SpecError(f"the service refused the plan ({answer.status_code}): {_detail(answer)}")
    job = answer.json()["id"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = httpx.get(f"{url}/v1/jobs/{job}", headers=headers, timeout=30.0).json()
        if status["status"] == JobStatus.SUCCEEDED:
            return httpx.get(f"{url}/v1/jobs/{job}/result", headers=headers, timeout=30.0).json(), job
        if status["status"] in TERMINAL:
            raise SpecError(f"job {job} {status['status']}: {status.get('error') or ''}")
        time.sleep(1.0)
    raise SpecError(f"job {job} did not finish within {timeout_s:.0f} s; see {url}/v1/jobs/{job}")


def _detail(answer: Any) -> str:
    try:
        return str(answer.json().get("detail", answer.text))
    except ValueError:
        return str(answer.text)


def _print_result(result: dict[str, Any]) -> None:
    """The best plan, stage by stage, and the baselines it beat."""
    best = result["best"]
    seconds = best.get("report", {}).get("iteration_time_s") or best.get("iteration_time_s")
    plan = best.get("plan", {})
    print(f"best plan: {seconds:.4g} s per iteration, {plan.get('micro_batches')} micro-batches, "
          f"{plan.get('schedule')}")
    for i, stage in enumerate(plan.get("stages", [])):
        start, end = stage["layers"]
        extras = ", recompute" if stage.get("recompute") else ""
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

    run_worker(Settings.from_env())
    return 0


def _create_key(args: argparse.Namespace) -> int:
    from tagplan.service.db import make_engine
    from tagplan.service.keys import create_key
    from tagplan.service.settings import Settings

    settings = Settings.from_env()
    settings.home.mkdir(parents=True, exist_ok=True)
    key = create_key(make_engine(settings.database_url), args.tenant, admin=args.admin)
    print(key)
    print(f"(tenant {args.tenant}{', admin' if args.admin else ''}; the key is stored hashed and shown only now)",
          file=sys.stderr)
    return 0


def _submit(args: argparse.Namespace) -> int:
    import httpx

    workload: dict[str, Any] = {"global_batch": args.batch}
    if args.seq:
        workload["seq_len"] = args.seq
    request = _plan_request({"model": args.model, "cluster": args.cluster, "workload": workload,
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
            answer = httpx.post(f"{args.url}/v1/plans", json=request, headers={"Authorization": f"Bearer {key}"},
                                timeout=30.0)
            if answer.status_code >= 400:
                raise SpecError(f"the service refused the plan ({answer.status_code}): {_detail(answer)}")
            print(json.dumps(answer.json(), indent=2))
            return 0
        result, _ = _submit_and_wait(args.url, key, request, timeout_s=args.timeout_s)
    except httpx.HTTPError as err:
        raise SpecError(f"submit: cannot reach the service at {args.url}: {err}") from None
    _print_result(result)
    return 0

