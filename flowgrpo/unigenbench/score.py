"""Judging UniGenBench images over an OpenAI-compatible endpoint, resumable, with every output.

:func:`judge_images` sends one request per image (:mod:`.protocol`) through the shared
:class:`~flowgrpo.rewards.openai_client.ChatClient` (at most ``workers`` in flight; bounded retries
of transport errors, HTTP 429/5xx, timeouts and unreadable answers, where a wrong-length score list
counts as unreadable). Each image is read and JPEG-encoded in a worker thread just before its
request, so memory stays flat over thousands of images. :func:`score_folder` is ``flowgrpo
unigenbench score``: it skips every image already in ``judgements.jsonl``, appends each new
judgement as it arrives, and writes ``summary.json``, ``scores.csv``, ``scores.png`` and
``report.html`` at the end.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from ..errors import UserError
from ..rewards.http_client import DEFAULT_MAX_RESPONSE_MB
from .generate import SETTINGS_NAME, read_settings
from .judgements import JudgementLog, file_sha256
from .prompts import BenchPrompt, PromptSet
from .protocol import judge_messages, judge_text, jpeg_data_url, parse_answer


@dataclass
class JudgeOptions:
    """Where and how to ask the judge.

    Attributes:
        url: the API root (``http://host:8080/v1``; a URL without a path gets ``/v1``).
        model: the served model name (``QwenVL`` in the official vLLM command).
        api_key_env: environment variable holding the API key (None: no key is sent).
        workers: requests in flight at once. timeout: seconds per attempt (the whole exchange).
        retries: extra attempts per image. backoff: first retry delay (s, doubling). max_tokens,
        temperature: sampling. max_response_mb: the largest answer read (MiB, decompressed).
    """

    url: str
    model: str = "QwenVL"
    api_key_env: str | None = None
    workers: int = 16
    timeout: float = 300.0
    retries: int = 3
    backoff: float = 1.0
    max_tokens: int = 2048
    temperature: float = 0.0
    max_response_mb: float = DEFAULT_MAX_RESPONSE_MB

    def base_url(self) -> str:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise UserError(f"--judge-url {self.url!r} is not an http(s) URL (e.g. http://127.0.0.1:8080/v1)")
        return self.url.rstrip("/") + ("/v1" if parts.path in ("", "/") else "")


@dataclass
class ImageTask:
    """One image to judge: its key ``{index}_{j}``, prompt, image (a path or a PIL image)."""

    key: str
    prompt: BenchPrompt
    j: int
    image: object


def _request(task: ImageTask, language: str) -> list[dict]:
    p = task.prompt
    return judge_messages(jpeg_data_url(task.image),
                          judge_text(language, p.prompt, list(p.testpoints), list(p.descriptions)))


def _record(task: ImageTask, outcome) -> dict:
    v = outcome.value
    return {"key": task.key, "index": task.prompt.index, "j": task.j,
            "image": task.image.name if isinstance(task.image, Path) else None, "ok": v is not None,
            "testpoints": list(task.prompt.testpoints), "scores": list(v.scores) if v else None,
            "analysis": list(v.analysis) if v else None, "answer": outcome.answer,
            "error": None if v else (outcome.error or "unreadable answer"), "attempts": outcome.attempts,
            "seconds": round(outcome.seconds, 4)}


#: the longest the reachability check waits for the judge's ``/models`` answer (s)
REACH_TIMEOUT_S = 10.0


def check_reachable(options: JudgeOptions) -> None:
    """Raise a one-line UserError when nothing answers at the judge's address (any HTTP answer,
    even an error status, counts as reachable); so a wrong port fails at once instead of
    recording every image as failed after its retries. The answer is read within the same bounds
    as a judgement's (a whole-exchange deadline, ``max_response_mb``)."""
    import httpx

    from ..rewards.http_client import HTTPLoop, ResponseRefused, max_response_bytes

    url = options.base_url()
    limit = max_response_bytes(options.max_response_mb, "--max-response-mb")
    timeout = min(options.timeout, REACH_TIMEOUT_S)
    with HTTPLoop("judge-reach", timeout) as http:
        try:
            http.run(http.fetch("GET", url + "/models", timeout=timeout, max_bytes=limit))
        except (httpx.TransportError, TimeoutError) as e:
            raise UserError(f"cannot reach the judge at {url} ({type(e).__name__}: {e}); is the server up?") from None
        except ResponseRefused as e:
            raise UserError(f"the judge at {url} {e}; refused (--max-response-mb {options.max_response_mb:g})") from None


def judge_images(tasks: list[ImageTask], language: str, options: JudgeOptions,
                 on_record: Callable[[dict], None] | None = None) -> tuple[list[dict], dict]:
    """Judge every task; returns (one record per task, in order; the client's request stats).

    ``on_record(record)`` runs as each judgement arrives (from the client's thread)."""
    from ..rewards.openai_client import ChatClient

    if not tasks:
        return [], {}
    check_reachable(options)
    client = ChatClient(options.base_url(), options.model, api_key_env=options.api_key_env,
                        max_concurrency=options.workers, timeout=options.timeout, retries=options.retries,
                        backoff=options.backoff, temperature=options.temperature, max_tokens=options.max_tokens,
                        max_response_mb=options.max_response_mb)
    records: list[dict | None] = [None] * len(tasks)

    def arrived(i: int, outcome) -> None:
        records[i] = _record(tasks[i], outcome)
        if on_record is not None:
            on_record(records[i])

    try:
        client.complete([functools.partial(_request, t, language) for t in tasks],
                        [functools.partial(parse_answer, num_checkpoints=len(t.prompt.testpoints)) for t in tasks],
                        on_outcome=arrived)
    finally:
        client.close()
    return records, dict(client.stats)


def folder_tasks(images_dir: Path, prompts: list[BenchPrompt], images_per_prompt: int) -> tuple[list[ImageTask], list[str]]:
    """(tasks for the ``{index}_{j}.png`` present, names of the missing ones)."""
    tasks, missing = [], []
    for p in prompts:
        for j in range(images_per_prompt):
            path = images_dir / f"{p.index}_{j}.png"
            if path.is_file():
                tasks.append(ImageTask(f"{p.index}_{j}", p, j, path))
            else:
                missing.append(path.name)
    return tasks, missing


def _progress(total: int, done: int, enabled: bool):
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    bar = Progress(TextColumn("[bold]judging"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"), disable=not enabled)
    return bar, bar.add_task("judge", total=total, completed=done, info="")


def score_folder(images_dir: str | Path, prompt_set: PromptSet, results_dir: str | Path, options: JudgeOptions,
                 images_per_prompt: int = 4, limit: int | None = None, retry_failed: bool = False,
                 progress: bool = True, report: bool = True) -> dict:
    """Judge ``images_dir``'s images of ``prompt_set`` (the first ``limit`` prompts) into ``results_dir``.

    Resumes from ``results_dir/judgements.jsonl``; writes ``summary.json`` and the leaderboard CSV
    (and with ``report`` the chart and ``report.html``). Returns the summary."""
    from .summary import build_summary, write_leaderboard_csv

    images_dir, results_dir = Path(images_dir), Path(results_dir)
    options.base_url()  # a malformed URL fails before anything else
    if not images_dir.is_dir():
        raise UserError(f"image folder {images_dir} does not exist")
    made = read_settings(images_dir)
    if made is not None and made.get("set") != prompt_set.name:
        raise UserError(f"{images_dir} holds images generated for set {made.get('set')!r} (see {SETTINGS_NAME}), "
                        f"not for set {prompt_set.name!r}: each would be judged against another prompt; "
                        f"score them with --set {made.get('set')}")
    prompts = prompt_set.limited(limit)
    tasks, missing = folder_tasks(images_dir, prompts, images_per_prompt)
    if not tasks:
        raise UserError(f"{images_dir} holds none of the {len(prompts) * images_per_prompt} images "
                        f"{{index}}_{{j}}.png of set {prompt_set.name} (make them with `flowgrpo unigenbench generate`)")
    for problem in prompt_set.problems:
        print(f"warning: {problem}")
    if missing:
        print(f"warning: {len(missing)} images missing (first: {', '.join(missing[:3])}); judged without them")
    meta = {"set": prompt_set.name, "judge_model": options.model, "prompts_sha256": file_sha256(prompt_set.source),
            "prompts_file": str(prompt_set.source), "images_dir": str(images_dir.resolve()), "judge_url": options.url}
    with JudgementLog(results_dir, meta) as log:
        todo = [t for t in tasks if t.key not in log.records or (retry_failed and not log.records[t.key].get("ok"))]
        if len(todo) < len(tasks):
            print(f"resuming: {len(tasks) - len(todo)} of {len(tasks)} images already judged in {log.path}")
        bar, bar_task = _progress(len(tasks), len(tasks) - len(todo), progress)
        failed = [0]

        def arrived(rec: dict) -> None:
            log.append(rec)
            failed[0] += not rec["ok"]
            bar.update(bar_task, advance=1, info=f"failed {failed[0]}" if failed[0] else "")

        t0 = time.perf_counter()
        with bar:
            _, stats = judge_images(todo, prompt_set.language, options, on_record=arrived)
        seconds = time.perf_counter() - t0
        records = [log.records[t.key] for t in tasks]
    summary = build_summary(prompt_set.name, prompt_set.language, options.model, records,
                            missing_images=len(missing), skipped_rows=len(prompt_set.problems),
                            this_run={"judged": len(todo), "requests": stats.get("requests", 0),
                                      "retries": stats.get("retries", 0), "seconds": round(seconds, 3)})
    (results_dir / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False), encoding="utf-8")
    write_leaderboard_csv(results_dir / "scores.csv", summary, prompt_set.language)
    if report:
        from .report import write_report

        write_report(results_dir, summary, prompts, records, images_dir, prompt_set.language)
    return summary
