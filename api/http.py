"""A small HTTP front door for producers that cannot speak Celery: POST a job, GET its row.

Run: `uvicorn api.http:app`. It only enqueues and reads; it never touches an engine.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from api.client import Client
from ocrq.contract import ImageRef
from ocrq.settings import Settings

app = FastAPI(title="ocrq", summary="Enqueue OCR jobs and read their results.")


class JobIn(BaseModel):
    image: ImageRef
    task: str = "text"


@lru_cache(maxsize=1)
def client() -> Client:
    return Client(Settings())


@app.post("/jobs", status_code=202)
def create_job(job: JobIn) -> dict[str, str]:
    image = job.image.model_dump(exclude_none=True)
    return {"job_id": client().submit(image, job.task)}


@app.get("/jobs/{job_id}")
def get_job(job_id: str) -> dict[str, Any]:
    row = client().status([job_id])[0]
    if row["status"] == "unknown":
        raise HTTPException(404, f"no job {job_id}")
    return row
