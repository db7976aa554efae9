"""A tensor-parallel run's secret, and the signed frames its ranks exchange through the store.

Why every value is signed: the ranks meet at a TCPStore, and a TCPStore asks no password. Any process
that reaches its port can connect, list every key (`list_keys`) and set any value, so a key's name is
no secret and a value's presence proves nothing. A rank therefore reads a value as data (a session, a
worker's spec, a step, a rank's answer) only once it has checked its HMAC-SHA256 under the run's
secret, bound to what the value is for (the session, the step, the rank): a value copied from one key
to another, or from an earlier step, fails the check as a forged one does. The keys themselves live
under a namespace derived from the secret (a hash of it, so that listing the keys tells nothing of the
secret), so two runs on one store never meet.
Signed is not hidden: a client of the store can read a step's token ids (docs/engine.md).

Where the secret comes from (docs/engine.md, "Launching"): rank 0 draws 128 random bits per engine
and hands them to the ranks it spawns in their environment (SECRET_ENV): /proc/PID/environ is
readable by the same user only, where the command line is anyone's. Under torchrun the launch sets
SECRET_ENV for every rank, the same value on every node, as it sets MASTER_ADDR.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import MutableMapping
from dataclasses import dataclass

SECRET_ENV = "KVSCOPE_TP_SECRET"
MIN_SECRET_CHARS = 32  # 128 bits as hex: what rank 0 draws, and the least a launcher may set
MAGIC = b"kvscope-tp1"  # a frame's first bytes: a value of some other writer is named as such
TAG_BYTES = hashlib.sha256().digest_size


class Refused(RuntimeError):
    """A value a rank will not act on (unsigned, signed for something else, or not the data it must be)."""


class SecretMissing(RuntimeError):
    """A torchrun launch without the run's secret: the message says how to set it."""


@dataclass(frozen=True, repr=False)  # repr=False: a secret never lands in a log line or a traceback
class RunSecret:
    key: bytes

    @classmethod
    def new(cls) -> "RunSecret":
        return cls(secrets.token_hex(16).encode())

    @classmethod
    def from_env(cls, environ: MutableMapping[str, str] | None = None, forget: bool = False) -> "RunSecret":
        """The secret a launcher set in SECRET_ENV (SecretMissing when absent or short); `forget`: drop it
        from this process's environment, so that nothing this process starts inherits it."""
        environ = os.environ if environ is None else environ
        value = environ.pop(SECRET_ENV, "") if forget else environ.get(SECRET_ENV, "")
        if len(value) < MIN_SECRET_CHARS:
            said = "is not set" if not value else f"has {len(value)} characters"
            raise SecretMissing(f"{SECRET_ENV} {said}: a tensor-parallel launch needs at least {MIN_SECRET_CHARS} "
                                "random characters, the same on every rank and node, e.g. "
                                f"`export {SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(16))')` "
                                "(docs/engine.md#tensor-parallelism)")
        return cls(value.encode())

    def environ(self) -> dict[str, str]:
        """What a spawned rank's environment adds to this process's."""
        return {SECRET_ENV: self.key.decode()}

    def namespace(self) -> str:
        """The store prefix of this run's keys: derived from the secret, never the secret itself."""
        return "kvscope/" + hmac.new(self.key, b"namespace", hashlib.sha256).hexdigest()[:32] + "/"

    def sign(self, purpose: str, body: bytes) -> bytes:
        """A frame: MAGIC, the HMAC of (purpose, body), then body."""
        return MAGIC + self._tag(purpose, body) + body

    def open(self, purpose: str, frame: bytes) -> bytes:
        """The body of a frame signed for `purpose` with this secret; Refused otherwise."""
        if not frame.startswith(MAGIC) or len(frame) < len(MAGIC) + TAG_BYTES:
            raise Refused(f"the value at {purpose} is not a kvscope frame (another process wrote it)")
        tag, body = frame[len(MAGIC):len(MAGIC) + TAG_BYTES], frame[len(MAGIC) + TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(purpose, body)):
            raise Refused(f"the value at {purpose} is not signed with this run's secret (another process wrote it, "
                          "or copied it from another key)")
        return body

    def _tag(self, purpose: str, body: bytes) -> bytes:
        mac = hmac.new(self.key, purpose.encode() + b"\0", hashlib.sha256)
        mac.update(body)
        return mac.digest()
