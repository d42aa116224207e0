"""The OpenAI Python SDK against pd-proxy's tenant limits (`--api-keys-file`, in a local cluster:
`pd-cluster --api-key ... --proxy-arg=--api-keys-file=...`): the SDK reads the x-ratelimit-*
headers of an answer, raises RateLimitError over the limit, and, left to retry, waits as
retry-after-ms says and gets its answer."""

import pathlib
import time
from typing import Iterator

import openai
import pytest
from conftest import local_cluster

KEYS = """
[tenants.slow]
keys = ["sk-slow"]
requests_per_second = 1
"""


@pytest.fixture
def limited_proxy(tmp_path: pathlib.Path) -> Iterator[str]:
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    flags = ("--api-key", "sk-demo", f"--proxy-arg=--api-keys-file={keys}")
    with local_cluster(tmp_path / "run", *flags) as url:
        yield url


def test_the_sdk_reads_the_limits_and_waits_as_told(limited_proxy: str) -> None:
    strict = openai.OpenAI(base_url=f"{limited_proxy}/v1", api_key="sk-slow", max_retries=0)
    raw = strict.completions.with_raw_response.create(model="sim-model", prompt="hi", max_tokens=2)
    assert raw.headers["x-ratelimit-limit-requests"] == "1"
    assert raw.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(openai.RateLimitError) as refused:
        strict.completions.create(model="sim-model", prompt="hi", max_tokens=2)
    assert refused.value.code == "rate_limit_exceeded"
    assert int(refused.value.response.headers["retry-after-ms"]) <= 1000
    # Left to retry, the SDK waits as retry-after-ms says, and is served.
    patient = openai.OpenAI(base_url=f"{limited_proxy}/v1", api_key="sk-slow", max_retries=3)
    started = time.monotonic()
    for _ in range(2):
        assert patient.completions.create(model="sim-model", prompt="hi", max_tokens=2).choices
    # Each call met the limit first (one request a second) and waited about a second.
    assert 1.0 <= time.monotonic() - started < 5
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{limited_proxy}/v1", api_key="sk-nobody",
                      max_retries=0).models.list()
