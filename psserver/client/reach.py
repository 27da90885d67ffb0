"""Whether a shard can be reached, said in one line within seconds: what a worker, psctl and psgrid.init ask first.

The client's own retries wait out a shard that is starting or restarting (``retry_s``); before
them, one look says what is wrong with an address that will never answer: nothing listens,
something that is not a psgrid shard answered (an HTTP server, a silent listener), or a TLS
handshake failed and why. Used by ``cluster/run/preflight.py`` and by ``psgrid.init``.
"""

from __future__ import annotations

import socket
import ssl
import time

# How long a worker waits for a shard's port to open before it says the shard cannot be reached:
# long enough for shards started at the same moment, short enough that a typo is told at once.
REACH_WAIT_S = 5.0
# How long a listener has to answer as a shard does (a shard answers at once, even under load).
ANSWER_WAIT_S = 3.0
NOT_TLS = "the shard does not speak TLS"
CLOSED = "it closed the connection without an answer"
# What a gRPC client first sends, and the frame type every HTTP/2 server answers with (RFC 9113, 3.4).
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HTTP2_EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
HTTP2_SETTINGS = 0x04


def probe(address: str, train, wait_s: float = REACH_WAIT_S) -> str | None:
    """What stops a worker with ``train``'s TLS settings from talking to the shard at ``address``; None if nothing."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=max(0.2, deadline - time.monotonic()))
            break
        except socket.gaierror as e:
            return f"unknown host {host!r} ({e.strerror}): check the address"
        except OSError as e:
            if time.monotonic() >= deadline:
                why = e.strerror or type(e).__name__
                return (
                    f"cannot connect for {wait_s:g} s ({why}): is the shard running, at that address? "
                    f"(psctl server prints its address; psctl launch starts shards and workers together)"
                )
            time.sleep(0.1)
    with sock:
        sock.settimeout(max(1.0, deadline - time.monotonic()))
        if train.tls_ca or train.tls_cert:
            problem = _tls_problem(sock, host, train)
            if problem and problem.startswith(NOT_TLS):  # a plaintext shard, or no shard at all?
                return _http2_problem(host, int(port), ANSWER_WAIT_S) or problem
            return problem
    answer = _http2_problem(host, int(port), ANSWER_WAIT_S)
    if answer and answer.startswith(CLOSED):  # a TLS shard closes on plaintext; say that, if so
        with socket.create_connection((host, int(port)), timeout=ANSWER_WAIT_S) as sock:
            return _plaintext_problem(sock, host) or answer
    return answer


def _http2_problem(host: str, port: int, wait_s: float) -> str | None:
    """Whether ``host:port`` answers as a gRPC server does (an HTTP/2 SETTINGS frame); else what answered."""
    not_shard = "not a psgrid shard: check the address (psctl server prints its own)"
    what = None
    try:
        with socket.create_connection((host, port), timeout=wait_s) as sock:
            sock.sendall(HTTP2_PREFACE + HTTP2_EMPTY_SETTINGS)
            data = b""
            while len(data) < 9:
                chunk = sock.recv(9 - len(data))
                if not chunk:
                    break
                data += chunk
    except TimeoutError:
        what = f"something listens there but did not answer in {wait_s:g} s"
    except OSError as e:
        what = f"{CLOSED} ({e.strerror or type(e).__name__})"
    else:
        if len(data) == 9 and data[3] == HTTP2_SETTINGS:
            return None
        if not data:
            what = CLOSED
        elif data.startswith(b"HTTP/") or data.lstrip().startswith(b"<"):
            what = "an HTTP server answered"
        elif data[0] == 0x15:  # a TLS alert record
            what = "a TLS server answered with an alert"
        else:
            what = f"it answered {data!r}, not HTTP/2"
    return f"{what}; {not_shard}"


def _tls_problem(sock: socket.socket, host: str, train) -> str | None:
    context = ssl.create_default_context(cafile=train.tls_ca)
    if train.tls_cert:
        context.load_cert_chain(train.tls_cert, train.tls_key)
    context.set_alpn_protocols(["h2"])
    handshaken = False
    try:
        with context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False) as tls:
            tls.do_handshake()
            handshaken = True
            # TLS 1.3: a shard refuses a client certificate after the client's side of the handshake, in an alert
            # that arrives with the first read; a shard that accepts sends its HTTP/2 settings instead.
            tls.settimeout(1.0)
            if tls.recv(1) == b"":  # gRPC closes without an alert
                return _refused_client(train)
    except ssl.SSLCertVerificationError as e:
        if e.verify_code == 62 or "hostname" in (e.verify_message or "").lower():
            return (
                f"its certificate is not for the name {host!r}: make the certificates with "
                f"'psctl certs DIR --host {host}', or reach the shard by a name its certificate has"
            )
        ca = train.tls_ca or "the system's CAs"
        return (
            f"TLS handshake failed: its certificate is not signed by [train] tls_ca ({ca}): unknown CA "
            f"({e.verify_message}); give the CA that signed the shard's certificate"
        )
    except ssl.SSLError as e:
        reason = (e.reason or "").upper()
        if "CERTIFICATE_REQUIRED" in reason or (not train.tls_cert and "HANDSHAKE_FAILURE" in reason):
            return (
                "TLS handshake failed: the shard requires a client certificate: set [train] tls_cert and "
                "tls_key (psctl certs DIR makes them)"
            )
        if "UNKNOWN_CA" in reason or "BAD_CERTIFICATE" in reason or "DECRYPT_ERROR" in reason:
            return (
                "TLS handshake failed: the shard does not accept our client certificate ([train] tls_cert is "
                "not signed by the CA of its [server] tls_ca)"
            )
        if "WRONG_VERSION_NUMBER" in reason or "RECORD_LAYER" in reason or "PACKET_LENGTH" in reason:
            return f"{NOT_TLS}: leave out [train] tls_ca/tls_cert, or start the shard with tls_cert and tls_key"
        return f"TLS handshake failed: {e.reason or e}"
    except TimeoutError:
        if not handshaken:
            return "something listens there but did not complete a TLS handshake: not a psgrid shard"
        return None  # nothing refused us: the shard waits for a request
    except (ConnectionError, OSError):
        return _refused_client(train)
    return None


def _refused_client(train) -> str:
    """The shard ended the connection after the handshake: it did not take our client certificate, or its absence."""
    if not train.tls_cert:
        return (
            "TLS handshake failed: the shard requires a client certificate: set [train] tls_cert and tls_key "
            "(psctl certs DIR makes them)"
        )
    return (
        f"TLS handshake failed: the shard does not accept our client certificate ([train] tls_cert "
        f"{train.tls_cert} is not signed by the CA of the shard's tls_ca)"
    )


def _plaintext_problem(sock: socket.socket, host: str) -> str | None:
    """A shard that speaks TLS answers a TLS hello; a plaintext gRPC shard does not."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False) as tls:
            tls.do_handshake()
    except ssl.SSLError as e:
        reason = (e.reason or "").upper()
        if "ALERT" not in reason:
            return None  # not TLS at all: a plaintext shard, as the job expects
    except OSError:
        return None
    return (
        "the shard speaks TLS and the job has no TLS settings for its workers: set [train] tls_ca (and "
        "tls_cert/tls_key if the shard requires client certificates)"
    )
