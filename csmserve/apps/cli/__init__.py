"""The `csmserve` command line: main.py (the parser and dispatch), one module per command (speak.py,
serve.py, bench.py; talk's is apps/talk/cli.py), and speak's text.py, output.py and progress.py."""
