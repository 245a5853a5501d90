"""``fdx/server`` stays the HTTP API (protocol, serving, SSE, metrics): under
3,500 raw lines (what ``find fdx/server -name '*.py' | xargs wc -l``
counts: comments, docstrings and blank lines included), and no module of
it imports a scheduler, the router or a queue (the deployments' business:
``fdx/deploy``, ``fdx/plugins/deployments``)."""

from __future__ import annotations

from pathlib import Path

from test_import_graph import import_graph

SERVER = Path(__file__).resolve().parents[1] / "fdx" / "server"
MAX_LINES = 3500


def raw_lines(path: Path) -> int:
    """Lines as ``wc -l`` counts them (newline characters)."""
    return path.read_bytes().count(b"\n")


def test_raw_line_counter() -> None:
    assert raw_lines(Path(__file__)) == len(Path(__file__).read_text().splitlines())


def test_server_is_under_3500_raw_lines() -> None:
    counts = {str(p.relative_to(SERVER)): raw_lines(p) for p in sorted(SERVER.rglob("*.py"))}
    total = sum(counts.values())
    biggest = sorted(counts.items(), key=lambda kv: -kv[1])[:5]
    assert total < MAX_LINES, f"fdx/server has {total} lines (wc -l), the cap is {MAX_LINES}; largest: {biggest}"


def _forbidden(module: str) -> bool:
    leaf = module.rpartition(".")[2]
    return (module.startswith(("fdx.plugins.schedulers", "fdx.plugins.deployments", "fdx.router"))
            or any(w in leaf for w in ("scheduler", "router", "queue")))


def test_server_imports_no_scheduler_router_or_queue_module() -> None:
    g = import_graph()
    assert any(m.startswith("fdx.server.") for m in g)  # the walk sees the server
    bad = [f"{m} -> {t} (line {n})" for m, deps in g.items() if m == "fdx.server" or m.startswith("fdx.server.")
           for t, n in deps.items() if _forbidden(t)]
    assert not bad, bad


def test_the_forbidden_names_catch_what_they_should() -> None:
    for m in ("fdx.plugins.schedulers.v1", "fdx.plugins.deployments.dp_global_queue", "fdx.router.proxy",
              "fdx.plugins.deployments.dp_replicas"):
        assert _forbidden(m), m
    for m in ("fdx.deploy.frontend", "fdx.deploy.deployment", "fdx.tool_calling", "fdx.core.messages"):
        assert not _forbidden(m), m
