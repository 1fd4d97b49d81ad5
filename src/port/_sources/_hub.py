"""The Hugging Face Hub read in place: `hf://org/name[@revision][/folder]` as HTTP range requests.

A Hub URL becomes the Hub's resolve URLs (`HF_ENDPOINT`), read by `HttpTransport`
with the Hub token (`HF_TOKEN`, `hf auth login`) sent to the Hub only; nothing goes
through the local cache (a repo id without `hf://` does: see `resolve`).

```python
hf_location("hf://org/name@v1.0/weights")   # ('org/name', 'v1.0', 'weights')
transport = hub_transport("hf://openai-community/gpt2")
```
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote, urlsplit

from .._errors import CheckpointError
from .._text import quoted, shortened
from ._http import HttpTransport
from ._safetensors import plain_name
from ._urls import reason, redact

_REPO = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
MAX_REPO_PART = 96  # characters in a repo's owner or name, as the Hub (and huggingface_hub's validate_repo_id) allows


def hf_location(url: str) -> tuple[str, str, str]:
    """`hf://org/name[@revision][/folder]` as (repo id, revision, folder).

    A revision with a `/` is written escaped (`@refs%2Fpr%2F1`); a one-part repo id
    (`hf://gpt2`) takes no folder.

    ```python
    hf_location("hf://org/name@v1.0/weights")   # ('org/name', 'v1.0', 'weights')
    ```
    """
    rest = urlsplit(url)
    segments = [s for s in (rest.netloc + rest.path).split("/") if s]
    if not segments:
        raise CheckpointError(f"{redact(url)}: no repo id (expected hf://org/name[@revision])")
    count = 1 if len(segments) == 1 or "@" in segments[0] else 2
    repo, _, revision = "/".join(segments[:count]).partition("@")
    folder = segments[count:]
    if not _REPO.match(repo) or any(not plain_name(s) for s in folder) or (revision == "" and "@" in url):
        raise CheckpointError(
            f"{redact(url)}: not a Hugging Face repo URL (expected hf://org/name[@revision][/folder])"
        )
    for part in repo.split("/"):
        if len(part) > MAX_REPO_PART:
            raise CheckpointError(
                f"{shortened(redact(url), 200)}: {quoted(part, 40)} is {len(part)} characters, more than the "
                f"{MAX_REPO_PART} a Hugging Face repo's owner or name may have"
            )
    return repo, unquote(revision) or "main", "/".join(folder)


def hub_transport(url: str) -> HttpTransport:
    """`hf://org/name[@revision]`: the Hub's resolve URLs (`HF_ENDPOINT`), read by range with
    the Hub token (`HF_TOKEN`, `hf auth login`) sent to the Hub only; no local cache.

    ```python
    hub_transport("hf://openai-community/gpt2").url("config.json")   # 'hf://openai-community/gpt2/config.json'
    ```
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers

    repo, revision, folder = hf_location(url)
    display = redact(url)
    if constants.HF_HUB_OFFLINE:
        raise CheckpointError(f"{display}: HF_HUB_OFFLINE is set; reading the Hub in place needs the network")

    base = f"{constants.ENDPOINT.rstrip('/')}/{repo}/resolve/{quote(revision, safe='')}"

    def locate(name: str) -> str:  # as huggingface_hub.hf_hub_url, with the endpoint read now
        return f"{base}/{quote(f'{folder}/{name}' if folder else name)}"

    try:
        headers = {k: v for k, v in build_hf_headers().items() if k.lower() == "authorization"}
    except Exception as e:  # noqa: BLE001 - a token source that failed (OIDC exchange, a token file)
        raise CheckpointError(f"{display}: cannot get the Hugging Face token ({reason(e)})") from None
    return HttpTransport(display, locate, headers)
