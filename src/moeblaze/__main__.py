"""``python -m moeblaze ...``: the same command line as the ``moeblaze`` console script."""

from .cli import main

if __name__ == "__main__":
    main()
