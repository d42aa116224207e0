"""HTTPS with certificates made by openssl in the test: the binding registers with a
bootstrap-server that lets writers in by their client certificates (--tls-client-ca), reads with
the CA alone, and names an unusable file; the OpenAI SDK talks to pd-proxy over HTTPS in a local
cluster with TLS everywhere (`pd-cluster --tls`)."""

import pathlib
import ssl
import subprocess
from typing import Callable, Dict, Iterator

import httpx
import openai
import pytest
from conftest import Server, local_cluster

import pd_bootstrap as pd


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_pki(tmp: pathlib.Path) -> Dict[str, str]:
    """A CA, a server certificate for localhost and 127.0.0.1, and a client certificate."""
    files = {name: str(tmp / name) for name in
             ["ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem"]}
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *curve, "-keyout", files["ca-key.pem"], "-out", files["ca.pem"],
            "-subj", "/CN=pd-test-ca", "-days", "1")
    for name, extensions in [
        ("server", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ]:
        csr, ext = tmp / f"{name}.csr", tmp / f"{name}.ext"
        ext.write_text(extensions)
        openssl("req", *curve, "-keyout", files[f"{name}-key.pem"], "-out", str(csr),
                "-subj", f"/CN={name}")
        openssl("x509", "-req", "-in", str(csr), "-CA", files["ca.pem"], "-CAkey",
                files["ca-key.pem"], "-CAcreateserial", "-out", files[f"{name}.pem"], "-days", "1",
                "-extfile", str(ext))
    return files


def test_writers_present_a_client_certificate_and_readers_need_only_the_ca(
        tmp_path: pathlib.Path, start_server: Callable[..., Server]) -> None:
    pki = make_pki(tmp_path)
    server = start_server("--tls-cert", pki["server.pem"], "--tls-key", pki["server-key.pem"],
                          "--tls-client-ca", pki["ca.pem"])
    url = f"https://localhost:{server.port}"
    writer = pd.BootstrapClient(url, ca_file=pki["ca.pem"], cert_file=pki["client.pem"],
                                key_file=pki["client-key.pem"])
    writer.register("engine-tls", 0, 0, 0, "tcp://127.0.0.1:41000")
    reader = pd.BootstrapClient(url, ca_file=pathlib.Path(pki["ca.pem"]), register_deadline=1.0)
    assert [w["engine_id"] for w in reader.workers()["workers"]] == ["engine-tls"]
    with pytest.raises(pd.Unauthorized) as refused:
        reader.register("engine-other", 0, 0, 0, "tcp://127.0.0.1:41001")
    assert "--tls-client-ca" in str(refused.value)
    # A client that does not trust the CA cannot connect.
    stranger = pd.BootstrapClient(url, call_deadline=0.5)
    with pytest.raises(pd.PdBootstrapError):
        stranger.workers()


def test_an_unusable_tls_file_is_named() -> None:
    with pytest.raises(pd.InvalidInput) as raised:
        pd.BootstrapClient("https://localhost:1", ca_file="/no/such/ca.pem")
    assert "/no/such/ca.pem" in str(raised.value)
    with pytest.raises(pd.InvalidInput) as raised:
        pd.BootstrapClient("https://localhost:1", cert_file="/tmp/only-a-cert.pem")
    assert "certificate and its key" in str(raised.value)


@pytest.fixture
def tls_cluster(tmp_path: pathlib.Path) -> Iterator[Dict[str, str]]:
    run_dir = tmp_path / "run"
    with local_cluster(run_dir, "--tls") as url:
        yield {"url": url, "ca": str(run_dir / "tls" / "cluster-ca.pem")}


def test_the_openai_sdk_over_https(tls_cluster: Dict[str, str]) -> None:
    http = httpx.Client(verify=ssl.create_default_context(cafile=tls_cluster["ca"]))
    client = openai.OpenAI(base_url=f"{tls_cluster['url']}/v1", api_key="unused",
                           max_retries=0, http_client=http)
    completion = client.completions.create(model="sim-model", prompt="hello over https",
                                           max_tokens=4)
    assert completion.choices[0].text
    streamed = client.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    # Without the CA the SDK refuses the proxy's certificate.
    untrusting = openai.OpenAI(base_url=f"{tls_cluster['url']}/v1", api_key="unused",
                               max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        untrusting.models.list()
