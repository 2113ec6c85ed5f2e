"""Reading the small JSON and YAML files of the model and the planner, with errors that name the file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_document(path: str | Path, error: type[Exception], what: str, yaml_format: bool = False) -> Any:
    """The parsed contents of the JSON (or, with `yaml_format`, YAML) file at `path`; a missing file or a
    syntax error raises `error`, saying which `what` file ("config", "cluster") it was."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise error(f"no {what} file at {path}") from None
    if yaml_format:
        import yaml  # noqa: PLC0415 (only the planner's cluster files are YAML)

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise error(f"{path} is not valid YAML: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path} is not valid JSON: {exc}") from None
