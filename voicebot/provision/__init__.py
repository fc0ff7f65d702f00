"""Model provisioning: model references -> local directories, and the offline bundle.

Public API:

- :func:`resolve_model` turns a config's model reference (local path, hub id or
  ``bundle:NAME``) into what an engine loads;
- :func:`pull` builds bundle entries from ``models/bundle.toml`` under
  ``<models.cache_dir>/models`` (downloads under ``<models.cache_dir>/downloads``);
- :func:`bundle_names_for` lists the entries a config needs;
- :func:`fetch_sdist` fetches a pinned source archive (test data);
- :func:`add_models_parser` adds ``voicebot models pull|list|path`` to a CLI.
"""

from __future__ import annotations

from pathlib import Path

from voicebot.config import ModelsConfig
from voicebot.provision.build import downloads_for, pull
from voicebot.provision.bundle import Bundle, Entry, Package, load_bundle
from voicebot.provision.cli import add_models_parser, models_command
from voicebot.provision.fetch import Downloads
from voicebot.provision.resolve import bundle_names_for, resolve_model


def fetch_sdist(name: str, version: str, sha256: str, models: ModelsConfig) -> Path:
    """The ``name==version`` source archive in ``<cache_dir>/downloads``, hash-checked."""
    return downloads_for(models).sdist(Package(name, version), sha256)


__all__ = [
    "Bundle",
    "Downloads",
    "Entry",
    "add_models_parser",
    "bundle_names_for",
    "fetch_sdist",
    "load_bundle",
    "models_command",
    "pull",
    "resolve_model",
]
