"""age encryption of exported weights (`save_weights_external` with `age_encryption_recipients`).

The cipher is the age format (age-encryption.org/v1) as implemented by `pyrage`, the Python
binding of the Rust `rage` crate: this module only parses recipients and calls it, and
writes no cryptography of its own. What SDK 0.38 documents for the field
(`SaveWeightsExternalRequest.age_encryption_recipients`) is what is done here:

- a recipient is a native X25519 key (`age1...`) or an SSH public key (`ssh-ed25519 ...`,
  `ssh-rsa ...`), as age itself accepts them;
- every exported file is encrypted to all recipients at once (any one identity decrypts
  it) and stored under its name plus `.age`, which `tinker_cookbook.weights.download`
  expects and strips after decrypting.

Invariants: `parse_recipients` either returns one recipient per entry or raises
InvalidRequest naming the first bad one, so the gateway refuses a bad list before any
event is written; the trainer parses the same strings again (they travel in the event),
so an export is encrypted to exactly the keys the request named.
"""

from __future__ import annotations

from typing import Optional

import pyrage

from openrl_core.errors import InvalidRequest

AGE_SUFFIX = ".age"
MAX_RECIPIENTS = 10  # as SDK 0.38 documents for save_weights_external
_SSH_PREFIXES = ("ssh-ed25519 ", "ssh-rsa ")


def parse_recipients(recipients: list[str]) -> list:
    """pyrage recipients for the request's strings; InvalidRequest for an empty list, too
    many, or any string age does not accept as a recipient."""
    if not recipients:
        raise InvalidRequest("age_encryption_recipients is empty; omit it to export unencrypted files")
    if len(recipients) > MAX_RECIPIENTS:
        raise InvalidRequest(f"age_encryption_recipients lists {len(recipients)} keys; at most {MAX_RECIPIENTS}")
    parsed = []
    for index, text in enumerate(recipients):
        key = text.strip() if isinstance(text, str) else ""
        try:
            if key.startswith(_SSH_PREFIXES):
                parsed.append(pyrage.ssh.Recipient.from_str(key))
            elif key.startswith("age1"):
                parsed.append(pyrage.x25519.Recipient.from_str(key))
            else:
                raise pyrage.RecipientError("neither an age1... key nor an ssh-ed25519 / ssh-rsa public key")
        except pyrage.RecipientError as exc:
            shown = key if len(key) <= 80 else key[:77] + "..."
            raise InvalidRequest(
                f"age_encryption_recipients[{index}] ({shown!r}) is not an age recipient: {exc}"
            ) from None
    return parsed


def encrypt_files(files: dict[str, bytes], recipients: Optional[list[str]]) -> dict[str, bytes]:
    """The files as stored: unchanged without recipients, else each one age-encrypted to
    every recipient and renamed `<name>.age`."""
    if recipients is None:
        return files
    keys = parse_recipients(recipients)
    return {name + AGE_SUFFIX: pyrage.encrypt(content, keys) for name, content in files.items()}
