"""The OpenAI Python SDK against pd-proxy in front of two models (a local cluster of sim
engines, `pd-cluster --models 2`): the models' list, completions and chat on each model and an
adapter, and an unknown model as the SDK's NotFoundError."""

from typing import Iterator

import openai
import pytest
from conftest import local_cluster


@pytest.fixture
def gateway(tmp_path) -> Iterator[str]:
    with local_cluster(tmp_path / "run", "--models", "2") as url:
        yield url


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
