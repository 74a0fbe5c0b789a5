"""HTTPS (`--ssl-certfile`, `--ssl-keyfile`, `--ssl-ca-certs`, `--ssl-cert-reqs`): a real server
with certificates from a test authority (trustme), reached by the `openai` client and by urllib;
client certificates asked for and required; flags that cannot work stop the server before it
listens, naming the flag."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import trustme

from hybridserve.model.demo import ensure_demo_model
from server_fixtures import ROOT, ServerProcess, running_server


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def pem(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The files a server and a client are given: the server's certificate and key, the
    authority's certificate, and a client certificate with its key in one file."""
    d = tmp_path_factory.mktemp("tls")
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    files = {
        "cert": d / "server.pem",
        "key": d / "server.key",
        "ca": d / "ca.pem",
        "client": d / "client.pem",
        "locked": d / "locked.key",  # the server's key under a passphrase
    }
    server_cert.cert_chain_pems[0].write_to_path(str(files["cert"]))
    for blob in server_cert.cert_chain_pems[1:]:
        blob.write_to_path(str(files["cert"]), append=True)
    server_cert.private_key_pem.write_to_path(str(files["key"]))
    ca.cert_pem.write_to_path(str(files["ca"]))
    from cryptography.hazmat.primitives import serialization  # (trustme's own dependency)

    key = serialization.load_pem_private_key(server_cert.private_key_pem.bytes(), password=None)
    locked = serialization.BestAvailableEncryption(b"secret")
    files["locked"].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, locked)
    )
    ca.issue_cert("client@example.com").private_key_and_cert_chain_pem.write_to_path(str(files["client"]))
    return {k: str(v) for k, v in files.items()}


def _client_context(pem: dict[str, str], with_cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pem["ca"])
    if with_cert:
        ctx.load_cert_chain(pem["client"])
    return ctx


@pytest.fixture(scope="module")
def https_server(pem: dict[str, str]) -> Iterator[ServerProcess]:
    flags = ("--ssl-certfile", pem["cert"], "--ssl-keyfile", pem["key"], "--max-num-seqs", "4")
    with running_server(*flags, tls=_client_context(pem)) as srv:
        yield srv


def _post(base: str, ctx: ssl.SSLContext | None, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60, context=ctx) as r:
        return dict(json.loads(r.read()))


def test_the_openai_client_talks_to_the_server_over_https(
    https_server: ServerProcess, pem: dict[str, str]
) -> None:
    assert https_server.base.startswith("https://")
    assert "listening on https://" in https_server.output()
    # (the client's own HTTP client type, given the context that trusts the test authority)
    with openai.DefaultHttpxClient(verify=_client_context(pem)) as http:
        client = openai.OpenAI(
            base_url=https_server.base + "/v1", api_key="x", http_client=http, max_retries=0
        )
        msgs = [{"role": "user", "content": "Hello"}]
        whole = client.chat.completions.create(model="demo", messages=msgs, max_tokens=8, temperature=0)  # type: ignore[arg-type]
        stream = client.chat.completions.create(
            model="demo",
            messages=msgs,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert whole.choices[0].message.content and streamed == whole.choices[0].message.content


def test_a_client_that_does_not_trust_the_certificate_or_speaks_plain_http_gets_no_answer(
    https_server: ServerProcess,
) -> None:
    body = {"prompt": "Hello", "max_tokens": 2}
    with pytest.raises(urllib.error.URLError) as err:
        _post(https_server.base, ssl.create_default_context(), body)  # (the system's authorities)
    assert isinstance(err.value.reason, ssl.SSLCertVerificationError)
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        _post(https_server.base.replace("https://", "http://"), None, body)
    assert https_server.proc.poll() is None and https_server.health_status() == 200


@pytest.mark.parametrize("reqs", ["1", "2"])
def test_client_certificates_from_the_authority_are_checked(pem: dict[str, str], reqs: str) -> None:
    flags = ("--ssl-certfile", pem["cert"], "--ssl-keyfile", pem["key"], "--ssl-ca-certs", pem["ca"])
    with running_server(*flags, "--ssl-cert-reqs", reqs, tls=_client_context(pem, with_cert=True)) as srv:
        body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
        assert _post(srv.base, _client_context(pem, with_cert=True), body)["choices"]
        # a certificate from another authority is refused either way
        stranger = _client_context(pem)
        stranger.load_cert_chain(_other_client_cert(Path(pem["client"]).parent))
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            _post(srv.base, stranger, body)
        if reqs == "2":  # required: no certificate, no answer
            with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
                _post(srv.base, _client_context(pem), body)
        else:  # optional: a client without one is served
            assert _post(srv.base, _client_context(pem), body)["choices"]


def _other_client_cert(d: Path) -> str:
    path = d / "stranger.pem"
    trustme.CA().issue_cert("stranger@example.com").private_key_and_cert_chain_pem.write_to_path(str(path))
    return str(path)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--ssl-certfile", "{cert}"], "--ssl-certfile needs --ssl-keyfile"),
        (["--ssl-keyfile", "{key}"], "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-ca-certs", "{ca}"], "--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile"),
        (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{dir}/none.key"], "--ssl-keyfile {dir}/none.key: no such file"),
        (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{locked}"], "the key needs a passphrase"),
        (["--ssl-certfile", "{key}", "--ssl-keyfile", "{cert}"], "not a PEM certificate and its private key"),
        (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-cert-reqs", "2"], "needs --ssl-ca-certs"),
        (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-cert-reqs", "3"], "must be 0 (none)"),
        (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-ca-certs", "{key}"], "--ssl-ca-certs"),
    ],
)  # fmt: skip
def test_tls_flags_that_cannot_work_stop_the_server_naming_the_flag(
    pem: dict[str, str], flags: list[str], says: str
) -> None:
    ensure_demo_model()
    values = {**pem, "dir": str(Path(pem["cert"]).parent)}
    argv = [sys.executable, "-m", "hybridserve", "serve", "demo", "--port", "0"]
    argv += [f.format(**values) for f in flags]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert says.format(**values) in done.stderr, done.stderr[-2000:]
    assert "listening" not in done.stderr + done.stdout
