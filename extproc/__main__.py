import sys

from extproc.cli import main

if __name__ == "__main__":  # a spawned tokenizer worker imports this module again: not a sidecar
    sys.exit(main())
