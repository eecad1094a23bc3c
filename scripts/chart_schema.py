"""The Helm chart's values.schema.json: its `config` value is the pd-extproc config, so that part
of the schema comes from the sidecar's own model (extproc.config.Config), never written twice.
The chart's other values are described by hand in the same file.

    python scripts/chart_schema.py          # refresh the config definitions in the file
    python scripts/chart_schema.py --check  # exit 1 if the file is stale (tests do this)

Draft-07, as Helm validates values: the definitions live under `definitions`. `config` is what
the user adds on top of the chart's own settings, so no key of it is required at the top (the
chart fills in the pools); below that, every object refuses keys the sidecar does not know.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `extproc` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extproc.config import Config

SCHEMA = Path(__file__).resolve().parent.parent / "deploy/helm/pd-extproc/values.schema.json"


def _untitled(node: Any) -> Any:
    """Without pydantic's generated titles: noise for Helm, and what changes between versions."""
    if isinstance(node, dict):
        return {
            k: _untitled(v) for k, v in node.items() if not (k == "title" and isinstance(v, str))
        }
    if isinstance(node, list):
        return [_untitled(each) for each in node]
    return node


def config_definitions() -> dict[str, Any]:
    """Config and every model it uses, as draft-07 definitions; Config itself optional-keyed."""
    generated = _untitled(Config.model_json_schema(ref_template="#/definitions/{model}"))
    definitions: dict[str, Any] = generated.pop("$defs")
    generated.pop("required", None)
    definitions["Config"] = generated
    return dict(sorted(definitions.items()))


def expected() -> str:
    schema = json.loads(SCHEMA.read_text())
    schema["definitions"] = config_definitions()
    schema["properties"]["config"] = {"$ref": "#/definitions/Config"}
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = expected()
    if argv == ["--check"]:
        if SCHEMA.read_text() != text:
            print(f"{SCHEMA} is stale: run python scripts/chart_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
