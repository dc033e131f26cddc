"""Where benchmarks keep their figures: results/<name>.json, written whole."""
import json
import pathlib


def save(path, data):
    """Writes data as JSON to path (creating its folder) and says where."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"\nwrote {path}")


def figure(columns, width=5):
    """A matplotlib figure (no display needed) with a row of `columns` subplots: (fig, axes)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, columns, figsize=(width * columns, 4.5))


def save_figure(fig, path):
    """Writes fig as a PNG to path (creating its folder) and says where."""
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")
