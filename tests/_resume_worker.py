"""The fresh process of the checkpoint acceptance test: restore, regenerate, finish the run.

Usage: ``python tests/_resume_worker.py JOBS.json RESULTS.json``. Each job names a variant of
``_resume_scenario`` and the files the test process saved at step k (the buffer checkpoint and
the producer's state). For each, this restores the buffer (the variant's ``in_flight``: "reissue",
or "resume"), replays the puts the reissued groups had lost (a resumed group kept them), replays
the same producer ticks to step n and writes the batches and final stats as JSON. A job that
raises reports its traceback instead.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import anyio

from _resume_scenario import Producer, Variant, drive, regenerate, resume, stats_record
from stalebuf import ReplayBuffer


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    variant = Variant(**job["variant"])
    with open(job["producer"]) as file:
        producer = Producer.from_json(json.load(file))
    result = ReplayBuffer.restore(
        job["checkpoint"],
        in_flight=variant.in_flight,  # type: ignore[arg-type]
        status_log_interval=None,
        filters=variant.group_filters(),  # code, never in a checkpoint: given again
    )
    buf = result.buffer
    restored = stats_record(buf.stats())
    again = (resume if variant.in_flight == "resume" else regenerate)(buf, producer, result.reissue)
    regenerated = stats_record(buf.stats())

    async def finish() -> list[dict[str, Any]]:
        return await drive(buf, producer, variant, variant.checkpoint_at + 1)

    batches = anyio.run(finish, backend=variant.backend)
    return {
        "id": variant.id,
        "reissued": [group.uid for group in result.reissue],
        "put_again": again,
        "restored_stats": restored,
        "regenerated_stats": regenerated,
        "batches": batches,
        "final_stats": stats_record(buf.stats()),
        "producer": producer.to_json(),
    }


def main(jobs_path: str, results_path: str) -> None:
    with open(jobs_path) as file:
        jobs = json.load(file)
    results = []
    for job in jobs:
        try:
            results.append(run_job(job))
        except Exception:
            results.append({"id": Variant(**job["variant"]).id, "error": traceback.format_exc()})
    with open(results_path, "w") as file:
        json.dump(results, file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
