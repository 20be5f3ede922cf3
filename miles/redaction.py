"""Masking secrets wherever they might surface: configs, command lines, log records, tracebacks, samples.

What counts as a secret: the values of secret-named config keys (`wandb_api_key`, `Authorization`), URL
credentials (`https://user:pass@host`), secret-named query parameters (`?key=`), `Bearer` and `Basic`
credentials and any `Authorization` header's value, and the values of this process's environment variables that
are secrets by their name (`HF_TOKEN`, `JUDGE_KEY`) or look like credentials whatever their name.
"""

from __future__ import annotations

import base64
import binascii
import functools
import logging
import math
import os
import re
import sys
import threading
import traceback
from collections import Counter
from typing import Any

_SECRET_ENDINGS = (
    "apikey",
    "token",
    "secret",
    "password",
    "passwd",
    "credential",
    "credentials",
    "authorization",
    "auth",
    "cookie",
    "privatekey",
    "accesskey",
    "secretkey",
)
"""Config keys whose values are masked: names ending so, compared in lower case without `_`, `-` or
spaces (`wandb_api_key`, `hf_token`, `X-Api-Key`, `Authorization`, `clientSecret`), not names that merely
contain the word (`max_new_tokens`, `prompt_key`)."""
_ENV_SECRET_SUFFIX = re.compile(r"(?i)[_-](key|pass|pwd|pat|creds)$")
"""Environment variable names whose values are secrets besides those of config keys: `*_KEY` (`JUDGE_KEY`),
`*_PASS`, `*_PWD`, `*_PAT`; after a separator, so that the shell's `PWD` / `OLDPWD` stay readable. Not for
config keys, where `prompt_key` / `label_key` name columns."""
_SECRET_QUERY_NAMES = ("key", "sig", "signature", "pwd")
"""URL query parameters masked besides those `_SECRET_ENDINGS` names (`?key=` is many APIs' key)."""
MASK = "***"
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s?#]+@")
"""Greedy up to the authority's last `@`: a password holding a raw `@` (`user:p@ss@host`) is masked whole."""
_QUERY_PARAM = re.compile(r"([?&;])([^=&#\s;]+)=([^&#\s;]*)")
_BEARER = re.compile(r"(?i)\b(bearer)\s+[a-z0-9._~+/=-]{8,}")
_BASIC = re.compile(r"(?i)\b(basic)\s+([a-z0-9+/]{4,}={0,2})(?![a-z0-9+/=])")
_AUTH_HEADER = re.compile(
    r"(?i)\b((?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?)"
    r"(?:(basic|bearer|digest|token|negotiate|ntlm|apikey)\s+)?([^\s\"',;}\]]+)"
)
"""An Authorization header's value, whatever its scheme (`Authorization: Token abc`, `'authorization': 'k'`)."""
_MIN_ENV_SECRET = 8
"""Values of secret-named environment variables at least this long are masked wherever they appear; shorter
ones would mask ordinary text."""
_MIN_CREDENTIAL = 16
_CREDENTIAL = re.compile(r"[A-Za-z0-9+/=_.~-]+")
"""The alphabet of API keys, tokens and their base64 / hex forms: no spaces, no `:` / `;` / `,` (lists)."""


def is_secret_name(name: str) -> bool:
    """Whether a config key, header or environment variable name names a secret (see `_SECRET_ENDINGS`)."""
    compact = re.sub(r"[\s_-]", "", str(name)).lower()
    return compact.endswith(_SECRET_ENDINGS)


@functools.lru_cache(maxsize=4096)
def _is_secret_env_name(name: str) -> bool:
    return is_secret_name(name) or _ENV_SECRET_SUFFIX.search(name) is not None


@functools.lru_cache(maxsize=1024)
def _is_existing_path(value: str) -> bool:
    """A secret-named variable may hold the path of a key file (`GOOGLE_APPLICATION_CREDENTIALS`): the path
    is no secret, and masking it would hide every mention of that folder."""
    return value.startswith(("/", "~")) and os.path.exists(os.path.expanduser(value))


def _entropy(text: str) -> float:
    """Shannon entropy in bits per character."""
    counts = Counter(text)
    return -sum(c / len(text) * math.log2(c / len(text)) for c in counts.values())


@functools.lru_cache(maxsize=4096)
def looks_like_credential(value: str) -> bool:
    """Whether an environment variable's value looks like a key or token, whatever the variable's name: 16+
    characters of a token alphabet, not a path, with upper and lower case letters and digits (most API keys),
    or 24+ characters of letters and digits that vary like random ones (hex tokens). Paths, locale names,
    `x86_64-pc-linux-gnu`, version strings and numbers stay readable."""
    if not _MIN_CREDENTIAL <= len(value) <= 4096 or not _CREDENTIAL.fullmatch(value):
        return False
    if value.startswith(("/", ".", "~")):
        return False
    lower, upper = any(c.islower() for c in value), any(c.isupper() for c in value)
    digits = sum(c.isdigit() for c in value)
    if not digits or not (lower or upper):
        return False
    if lower and upper and digits >= 2:
        return _entropy(value) >= 3.0
    return len(value) >= 24 and _entropy(value) >= 3.5


def _env_secrets() -> list[str]:
    """The values of this process's environment that are secrets, longest first (a secret holding another is
    masked whole)."""
    found = {
        value
        for name, value in os.environ.items()
        if (len(value) >= _MIN_ENV_SECRET and _is_secret_env_name(name) and not _is_existing_path(value))
        or looks_like_credential(value)
    }
    return sorted(found, key=len, reverse=True)


def _mask_basic(m: re.Match[str]) -> str:
    """`Basic <base64 of user:password>`; other text after the word "basic" ("basic arithmetic") stays."""
    token = m.group(2)
    if len(token) % 4:
        return m.group(0)
    try:
        decoded = base64.b64decode(token, validate=True)
    except (binascii.Error, ValueError):
        return m.group(0)
    return f"{m.group(1)} {MASK}" if b":" in decoded else m.group(0)


def _mask_auth_header(m: re.Match[str]) -> str:
    scheme = f"{m.group(2)} " if m.group(2) else ""
    return f"{m.group(1)}{scheme}{MASK}"


def redact_text(text: str) -> str:
    """`text` with what looks like a secret masked: the values of secret environment variables (by name or by
    looks, `_env_secrets`), the credentials of a URL (`https://user:pass@host`), the values of secret-named
    query parameters (`?key=`, `&access_token=`), an Authorization header's value, and Bearer and Basic
    credentials anywhere."""
    if not text:
        return text
    for value in _env_secrets():
        if value in text:
            text = text.replace(value, MASK)
    text = _URL_USERINFO.sub(lambda m: f"{m.group(1)}{MASK}@", text)

    def query(m: re.Match[str]) -> str:
        name = m.group(2)
        secret = is_secret_name(name) or name.lower().replace("-", "_") in _SECRET_QUERY_NAMES
        return f"{m.group(1)}{name}={MASK}" if secret and m.group(3) else m.group(0)

    text = _QUERY_PARAM.sub(query, text) if "=" in text else text
    lowered = text.lower()
    if "authorization" in lowered:
        text = _AUTH_HEADER.sub(_mask_auth_header, text)
    if "bearer" in lowered:
        text = _BEARER.sub(lambda m: f"{m.group(1)} {MASK}", text)
    if "basic" in lowered:
        text = _BASIC.sub(_mask_basic, text)
    return text


def redact(config: Any) -> Any:
    """Config copy with secret-looking values masked, for logs, W&B and the run's files: the values of
    secret-named keys (`is_secret_name`) at any depth, in dicts and lists, and secrets inside any other string
    (`redact_text`)."""
    if isinstance(config, dict):
        return {k: _mask_all(v) if is_secret_name(k) else redact(v) for k, v in config.items()}
    if isinstance(config, list | tuple):
        return type(config)(redact(v) for v in config)
    if isinstance(config, str):
        return redact_text(config)
    return config


def _mask_all(value: Any) -> Any:
    """Every leaf of a secret-named key's dict or list (`auth: {user: u, password: p}`) masked."""
    if isinstance(value, dict):
        return {k: _mask_all(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_mask_all(v) for v in value)
    return MASK if value else value


def redact_args(args: list[str]) -> list[str]:
    """Command-line arguments with secrets masked: the value of a `key=value` override whose key, or a key
    inside whose dict value (`headers={Authorization: ...}`), names a secret, and `redact_text`'s finds."""
    out = []
    for arg in args:
        key, eq, value = arg.partition("=")
        inner = re.findall(r"([A-Za-z0-9_.-]+)\s*:", value) if eq else []
        if eq and (is_secret_name(key.rsplit(".", 1)[-1]) or any(is_secret_name(k) for k in inner)):
            arg = f"{key}={MASK}"
        out.append(redact_text(arg))
    return out


def redact_yaml(text: str) -> str:
    """A resolved config's YAML with its secrets masked (`redact`), for the run folder's config.yaml."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
    return OmegaConf.to_yaml(OmegaConf.create(redact(container)))


class RedactingFilter(logging.Filter):
    """Masks secrets (`redact_text`) in every record a handler writes, its traceback included: an error
    message that quotes a URL with credentials (a remote reward's) stays out of the console and run.log."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: the handler reports it as it would have
            return True
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
            clean = redact_text(text)
            if clean != text:
                record.exc_text = clean
        return True


def _print_redacted(exc_type: Any, value: Any, tb: Any, header: str = "") -> None:
    text = header + "".join(traceback.format_exception(exc_type, value, tb))
    try:
        sys.stderr.write(redact_text(text))
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed: nowhere to print, as the default hook would find
        pass


def _redacting_excepthook(exc_type: Any, value: Any, tb: Any) -> None:
    """sys.excepthook: an uncaught exception's traceback, masked, on stderr (which W&B's console captures)."""
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, value, tb)
        return
    _print_redacted(exc_type, value, tb)


def _redacting_thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else threading.get_ident()
    _print_redacted(args.exc_type, args.exc_value, args.exc_traceback, f"Exception in thread {name}:\n")


def redact_logs() -> None:
    """Add `RedactingFilter` to the root logger's handlers (and logging's last-resort one), once each, and mask
    the tracebacks of uncaught exceptions (main thread and others) unless a hook of someone else's is set."""
    handlers = [*logging.getLogger().handlers, logging.lastResort]
    for handler in handlers:
        if handler is not None and not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _redacting_excepthook
    if threading.excepthook is threading.__excepthook__:
        threading.excepthook = _redacting_thread_excepthook
