"""Corpus mode of tools.golden: a prompt set split into tasks that resume and fan out over Ray.

    python -m tools.golden --engine reference --model M.gguf --prompts P.jsonl --out DIR --corpus \\
        [--task-size N] [--ray [--workers N] | --ray-address ADDR]

The prompts are cut, in file order, into tasks of --task-size prompts (task-00000, task-00001, ...).
A worker loads the model once and runs task after task; a task writes its goldens into DIR and then
DIR/tasks/<task>.json (its prompt ids, the run it belongs to, its manifest entries), every file to a
temporary name first and renamed when complete. A task whose part file exists, for the same run and
the same content, is skipped: an interrupted run resumes where it stopped and a re-run is
idempotent. The content is the model's sha256 (the checkpoint's weights for transformers; hashed
again only when the file's stat changes), each prompt's digest (its JSON, keys sorted) and every
option that changes its logits (RUN_KEYS); a model replaced under its name, or a prompt edited under
its id, makes the task run again, and a golden file that no longer matches its sha256 does too. A part file that is not one this module wrote (not JSON, or a field missing or of the
wrong type: damaged by hand or on disk) proves nothing, so its task counts as not done and is run
again, which rewrites it. Temporaries a killed run left behind are deleted at start. At the end
DIR/manifest.json gets the entries of every finished task in prompt order, as tools.golden writes
it, so tools.diff reads a corpus directory like any golden directory.

Workers: in-process by default (one). --ray starts a local Ray cluster with --workers actor
processes (default one per CPU); --ray-address joins an existing one (then the package must be
importable and the model, prompts and DIR readable at the same paths on every node: a shared
filesystem; an address where nothing accepts a TCP connection is refused at once, where ray.init
would retry it for minutes). Each actor holds one model. The model is checked before Ray starts or
the progress bar opens, so a bad one is one line and exit status 2. A task that raises is reported
failed with its reason and leaves no part file, so the next run retries it; the summary lists done,
failed and skipped tasks, and the exit status is 1 when any failed.

This module is no command of its own: `python -m tools.corpus` says so and exits 2.
"""
from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from pathlib import Path

from reference import artifacts
from reference.cli import INTEGER, UsageError, fail

from tools.common import REPO, GoldenError, save_json, sha256
from tools.parity.engines import make_engine, preflight
from tools.parity.golden_files import (MANIFEST, OURS as GOLDEN_OURS, golden_entry, make_dir, missing_goldens,
                                       refuse_overwrite, run_header)

TASKS = "tasks"
# the options that decide an engine's goldens: a corpus directory holds one run of them
RUN_KEYS = {"reference": ("model", "dtype", "kv", "ubatch_size", "numerics", "backend", "cache_type_k", "cache_type_v",
                          "kv_type", "flash_attn", "repack", "no_repack", "cpu", "threads"),
            "llama-cpp": ("model", "cache_type_k", "cache_type_v", "kv_type", "flash_attn", "ubatch_size", "ctx_size",
                          "repack", "no_repack", "threads"),
            "llama-server": ("server_url", "n_probs"), "openai": ("server_url", "n_probs"),
            "transformers": ("checkpoint",)}
# a corpus directory: a golden one, or one whose tasks/ holds part files only (a run not yet merged)
OURS = {**GOLDEN_OURS, TASKS: lambda path: os.path.isdir(path) and all(
    name.endswith(".json") or name.startswith(".") for name in os.listdir(path))}
RAY_CONNECT_TIMEOUT = 10  # seconds for a cluster's port to accept a connection (a LAN answers in ms)


def split_tasks(prompts: list[dict], size: int) -> list[dict]:  # -> [{"name", "prompts"}]
    return [{"name": f"task-{i // size:05d}", "prompts": prompts[i:i + size]} for i in range(0, len(prompts), size)]


def run_key(args) -> dict:  # -> RUN_KEYS of the engine, with file names only, never machine paths
    key = {"engine": args.engine, "n_predict": args.n_predict}
    for k in RUN_KEYS[args.engine]:
        key[k] = Path(getattr(args, k)).name if k in ("model", "checkpoint") else getattr(args, k)
    if getattr(args, "logits_positions", None):  # a resumed run keeps the rows it started with
        key.update(logits_positions=args.logits_positions[0], logits_topk=args.logits_topk)
    return key


def model_digest(args) -> dict:  # -> {file name: sha256} of what the engine's logits come from
    if args.engine == "transformers":
        weights = sorted(Path(args.checkpoint).glob("*.safetensors"))
        return {w.name: sha256(w) for w in weights}
    return {Path(args.model).name: sha256(args.model)} if args.model else {}  # a server without --model: its URL


def content_key(args, task: dict) -> dict:  # -> what a task's goldens are made of, beyond the run's options
    return {"model": model_digest(args), "prompts": [artifacts.content_digest(p) for p in task["prompts"]]}


def part_path(out: Path, task: dict) -> Path:
    return out / TASKS / f"{task['name']}.json"


def is_part(part) -> bool:  # -> whether `part` has every field, of its type, that Worker.run writes
    if not isinstance(part, dict) or not isinstance(part.get("content"), dict):
        return False
    header, ids, entries = part.get("header"), part.get("prompt_ids"), part.get("entries")
    return (isinstance(part.get("run"), dict) and isinstance(header, dict)
            and isinstance(header.get("options"), dict) and isinstance(header.get("date"), str)
            and isinstance(ids, list) and bool(ids) and all(isinstance(i, str) for i in ids)
            and isinstance(entries, list) and len(entries) == len(ids)
            and all(isinstance(e, dict) and "file" in e and (e["file"] is None or is_name(e["file"]))
                    and isinstance(e.get("sha256", {}), dict) for e in entries)
            and all(is_name(name) for e in entries for name in e.get("sha256", {})))


def is_name(name) -> bool:  # -> whether a part file names a golden file inside the directory
    return isinstance(name, str) and Path(name).name == name and not name.startswith(".")


def read_part(out: Path, task: dict) -> dict | None:  # -> the task's part, None if missing or damaged
    if not part_path(out, task).exists():
        return None
    try:
        part = artifacts.read_json(part_path(out, task), GoldenError, what="part file")
    except GoldenError:
        return None
    return part if is_part(part) else None  # damaged: the task is run again (module doc)


def task_done(out: Path, task: dict, key: dict, content: dict) -> bool:
    """Done: a part of this run, made of this content, whose files are still the ones it lists."""
    part = read_part(out, task)
    if part is None:
        return False
    if part["run"] != key:
        raise GoldenError(f"{out}: holds goldens of another run ({part['run']}); choose a new --out")
    ids = [str(p["id"]) for p in task["prompts"]]
    return part["prompt_ids"] == ids and part["content"] == content and all(
        (out / name).is_file() and sha256(out / name) == digest
        for e in part["entries"] for name, digest in e.get("sha256", {}).items())


def sweep_temporaries(out: Path) -> int:  # -> how many a killed run left behind
    stale = [p for d in (out, out / TASKS) if d.is_dir() for p in d.iterdir()
             if p.name.startswith(".") and ".tmp" in p.name]
    for p in stale:
        p.unlink(missing_ok=True)
    return len(stale)


class Worker:
    """One model, many tasks. Constructed inside the worker process (a Ray actor or this one)."""

    def __init__(self, args):
        self.args = args
        self.engine = make_engine(args)

    def ready(self) -> bool:  # a Ray actor answers once its model is loaded
        return True

    def run(self, task: dict) -> dict:  # -> {"task", "status": "done" | "failed", "reason"}
        out = self.args.out
        try:
            entries = [golden_entry(self.engine, p, out, self.args.n_predict) for p in task["prompts"]]
            save_json(part_path(out, task), {"run": run_key(self.args), "content": content_key(self.args, task),
                                             "header": run_header(self.engine, self.args.prompts),
                                             "prompt_ids": [str(p["id"]) for p in task["prompts"]],
                                             "entries": entries})
            return {"task": task["name"], "status": "done"}
        except Exception as e:  # a bad prompt fails its task, not the run
            return {"task": task["name"], "status": "failed", "reason": f"{type(e).__name__}: {e}".splitlines()[0]}


def failed_tasks(todo: list[dict], what: str, error: BaseException) -> list[dict]:  # -> results saying why
    reason = what + ": " + traceback.format_exception_only(type(error), error)[-1].strip().splitlines()[-1]
    return [{"task": t["name"], "status": "failed", "reason": reason} for t in todo]


def load_worker(args, todo: list[dict]) -> tuple[Worker | None, list[dict]]:  # -> (worker, failed results)
    try:
        return Worker(args), []
    except (GoldenError, UsageError):
        raise  # bad input, such as a model file that is not a GGUF or a package not installed: one line, exit 2
    except Exception as e:
        return None, failed_tasks(todo, "engine load failed", e)


def run_in_process(worker: Worker, todo: list[dict], progress) -> list[dict]:
    results = []
    for task in todo:
        results.append(worker.run(task))
        progress.update()
    return results


def check_ray_address(address: str) -> None:
    """ray.init retries an address where no Ray listens for minutes, deaf to SIGTERM: see first that
    its port accepts a TCP connection. "auto" and "local" name no port: Ray finds the cluster this
    node joined, or starts one, or says at once that there is none."""
    if address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not (INTEGER.fullmatch(port) and len(port) <= 5) or not 0 < int(port) < 65536:
        raise GoldenError(f"--ray-address {address!r}: expected auto, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT).close()
    except OSError as e:  # refused, unknown host, timed out
        raise GoldenError(f"--ray-address {address}: no Ray cluster reachable there ({e.strerror or e})") from None


def start_ray(args):  # -> the ray module, joined to --ray-address or to a local cluster it started
    if args.ray_address:
        check_ray_address(args.ray_address)
    try:
        import ray
    except ImportError:
        raise GoldenError("--ray needs the ray package (pip install -e \".[corpus]\")") from None
    try:
        if args.ray_address:
            ray.init(address=args.ray_address, log_to_driver=False)
        else:
            ray.init(num_cpus=args.workers or os.cpu_count(), include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    except ConnectionError as e:  # "auto" on a node that joined no cluster
        option = f"--ray-address {args.ray_address}" if args.ray_address else "--ray"
        raise GoldenError(f"{option}: {str(e).splitlines()[0]}") from None
    return ray


def run_ray(ray, args, todo: list[dict], progress, timing: dict, start: float) -> list[dict]:
    """One actor per worker process, each with its own model; a task goes to whichever actor is free.
    timing["start"] gets the seconds from `start` until every actor holds its model."""
    try:
        n_workers = min(args.workers or int(ray.cluster_resources().get("CPU", 1)), len(todo))
        remote_worker = ray.remote(num_cpus=1)(Worker)
        idle = [remote_worker.remote(args) for _ in range(n_workers)]
        try:
            ray.get([actor.ready.remote() for actor in idle])
        except Exception as e:
            return failed_tasks(todo, "engine load failed", e)
        timing["start"] = time.perf_counter() - start
        pending, queue, results = {}, list(todo), []
        while queue or pending:
            while idle and queue:
                actor, task = idle.pop(), queue.pop(0)
                pending[actor.run.remote(task)] = (actor, task)
            ready, _ = ray.wait(list(pending), num_returns=1)
            actor, task = pending.pop(ready[0])
            try:
                results.append(ray.get(ready[0]))
                idle.append(actor)
            except Exception as e:  # the actor died: its task fails and it takes no more
                results += failed_tasks([task], "worker died", e)
                if not idle and not pending:
                    results += failed_tasks(queue, "no worker left", e)
                    queue = []
            progress.update()
        return results
    finally:
        ray.shutdown()


def merge_manifest(out: Path, tasks: list[dict]) -> list[dict]:  # -> the entries written
    parts = [p for p in (read_part(out, t) for t in tasks) if p is not None]
    if not parts:
        return []
    header = dict(parts[0]["header"])
    dates = sorted({p["header"].get("date") for p in parts} - {None})
    for p in parts[1:]:
        if {k: p["header"].get(k) for k in ("engine", "version", "model")} != \
                {k: header.get(k) for k in ("engine", "version", "model")}:
            raise GoldenError(f"{out}: tasks were made by different engines or models")
    # workers on other machines may report other thread counts or CPU features: keep each one's
    differing = {p["prompt_ids"][0]: p["header"]["options"] for p in parts
                 if p["header"]["options"] != header["options"]}
    header.update(date=dates[-1], dates=dates)
    if differing:
        header["options_of_tasks_starting_at"] = differing
    entries = [e for p in parts for e in p["entries"]]
    partial = {"incomplete": {"reason": "tasks not done", "tasks_done": len(parts), "tasks": len(tasks)}} \
        if len(parts) < len(tasks) else {}
    save_json(out / MANIFEST, {**header, "corpus": {"tasks": len(tasks), "tasks_done": len(parts)},
                               "entries": entries, **partial})
    return entries


def summary_lines(done: list[dict], failed: list[dict], skipped: int, seconds: float, timing: dict) -> list[str]:
    lines = [f"corpus: {len(done)} done, {len(failed)} failed, {skipped} skipped in {seconds:.1f} s"]
    if done and seconds > 0:
        rate = f"  {60 * len(done) / seconds:.1f} tasks/minute"
        if timing.get("start"):
            after = seconds - timing["start"]
            rate += (f" ({timing['start']:.1f} s to start the workers; "
                     f"{60 * len(done) / after:.1f} tasks/minute after)")
        lines.append(rate)
    return lines + [f"  failed {r['task']}: {r['reason']}" for r in failed]


def run_corpus(args, prompts: list[dict]) -> int:  # -> exit status: 0 all tasks done, 1 some failed
    from tqdm import tqdm

    out = args.out
    refuse_overwrite(args, prompts, out, OURS)
    make_dir(out / TASKS)
    swept = sweep_temporaries(out)
    tasks = split_tasks(prompts, args.task_size)
    key = run_key(args)
    todo = [t for t in tasks if not task_done(out, t, key, content_key(args, t))]
    skipped = len(tasks) - len(todo)
    use_ray = args.ray or bool(args.ray_address)
    where = f"ray {args.ray_address}" if args.ray_address else "local ray" if use_ray else "in-process"
    start, timing = time.perf_counter(), {}
    # the model is checked (in-process: loaded) and Ray joined before the progress bar opens, so that
    # bad input is one line on stderr
    worker, ray, results = None, None, []
    if todo and use_ray:
        preflight(args)
        ray = start_ray(args)
    elif todo:
        worker, results = load_worker(args, todo)
    with tqdm(total=len(tasks), initial=skipped, desc=f"{args.engine} {out.name} ({where})", unit="task") as progress:
        if ray:
            results = run_ray(ray, args, todo, progress, timing, start)
        elif worker:
            results = run_in_process(worker, todo, progress)
    seconds = time.perf_counter() - start
    done = [r for r in results if r["status"] == "done"]
    failed = [r for r in results if r["status"] == "failed"]
    entries = merge_manifest(out, tasks)
    lines = summary_lines(done, failed, skipped, seconds, timing)
    if swept:
        lines.append(f"  removed {swept} temporary files of an interrupted run")
    lines.append(f"  {out / MANIFEST}: {len(entries)} of {len(prompts)} prompts")
    print("\n".join(lines))
    return 1 if failed else missing_goldens(entries, len(prompts))


if __name__ == "__main__":  # a library of tools.golden, not a command of its own
    sys.exit(fail("tools.corpus", "not a command: run python -m tools.golden ... --corpus (see its --help)"))
