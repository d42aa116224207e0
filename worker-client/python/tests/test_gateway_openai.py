"""The OpenAI Python SDK against pd-proxy in front of two models (a local cluster of sim
engines, `pd-cluster --models 2`): the models' list, completions and chat on each model and an
adapter, and an unknown model as the SDK's NotFoundError."""

import re
import signal
import subprocess
from typing import Iterator

import openai
import pytest
from conftest import server_binary


@pytest.fixture
def gateway(tmp_path) -> Iterator[str]:
    bin_dir = server_binary().parent
    cluster = subprocess.Popen(
        [str(bin_dir / "pd-cluster"), "--bin-dir", str(bin_dir), "--run-dir", str(tmp_path / "run"),
         "--port", "0", "--models", "2", "--no-kv-events", "--clean"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert cluster.stdout is not None
    url, seen = None, []
    for line in cluster.stdout:
        seen.append(line)
        found = re.match(r"\s+proxy: (http://\S+)", line)
        url = found.group(1) if found else url
        if line.startswith("Press Ctrl-C"):
            break
    assert url, "".join(seen)
    try:
        yield url
    finally:
        cluster.send_signal(signal.SIGINT)
        rest, _ = cluster.communicate(timeout=30)
        assert cluster.returncode == 0, "".join(seen) + rest


def test_the_sdk_lists_every_model_and_calls_each(gateway: str) -> None:
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
    models = {model.id: model for model in client.models.list()}
    assert sorted(models) == ["sim-lora-a", "sim-lora-b", "sim-model-0", "sim-model-1"]
    assert models["sim-lora-a"].model_extra["parent"] == "sim-model-0"
    for model in ["sim-model-0", "sim-model-1", "sim-lora-b"]:
        completion = client.completions.create(model=model, prompt="hello there", max_tokens=4)
        assert completion.model == model
        assert completion.choices[0].text
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.model == model
        assert chat.choices[0].message.content
    streamed = client.completions.create(
        model="sim-model-1", prompt="stream me", max_tokens=4, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert missing.value.code == "model_not_found"
    assert "sim-model-1" in str(missing.value)
