"""How `minivllm serve` runs its HTTP server: vLLM's --ssl-keyfile / --ssl-certfile (HTTPS)
and --root-path (behind a proxy's path prefix), with a certificate made by openssl and the
real openai client; --disable-fastapi-docs."""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request

import httpx
import openai
import pytest

from tests.entrypoints.openai.utils import RemoteServer

pytestmark = pytest.mark.e2e


def status_of(url: str, context: ssl.SSLContext | None) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10, context=context) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl to make a certificate")
    folder = tmp_path_factory.mktemp("tls")
    key, cert = str(folder / "key.pem"), str(folder / "cert.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
         "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return key, cert


def test_https_under_a_root_path(certificate):
    key, cert = certificate
    context = ssl.create_default_context(cafile=cert)
    server = RemoteServer(
        ["--max-model-len", "128", "--served-model-name", "tls", "--ssl-keyfile", key,
         "--ssl-certfile", cert, "--root-path", "/llm"],
        ssl_context=context,
    )  # fmt: skip
    try:
        client = openai.OpenAI(
            base_url=server.url_for("v1"), api_key="none", http_client=httpx.Client(verify=context)
        )
        reply = client.completions.create(
            model="tls", prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True}
        )  # (no end of text can cut it short, whatever this CPU's greedy path)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
        # Behind a proxy that strips /llm: the API describes itself under the prefix.
        with urllib.request.urlopen(server.url_for("openapi.json"), context=context) as answer:
            assert json.load(answer)["servers"] == [{"url": "/llm"}]
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=10)
        assert "serving tls on https://" in server.log_text()
    finally:
        server.stop()


def test_docs_can_be_switched_off():
    from starlette.testclient import TestClient

    from minivllm.entrypoints.cli import make_parser
    from minivllm.entrypoints.openai.api_server import build_app

    for flags, status in (([], 200), (["--disable-fastapi-docs"], 404)):
        client = TestClient(build_app(make_parser().parse_args(["serve", *flags])))
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert client.get(path).status_code == status, (flags, path)
