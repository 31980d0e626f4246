"""`python -m miniinfer ...` is the `miniinfer` command: see miniinfer/cli.py."""

from miniinfer.cli import main

if __name__ == "__main__":
    main()
