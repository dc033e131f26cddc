"""Where benchmarks keep their figures: results/<name>.json, written whole."""
import json
import pathlib


def save(path, data):
    """Writes data as JSON to path (creating its folder) and says where."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"\nwrote {path}")
