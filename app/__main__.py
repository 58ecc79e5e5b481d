"""``python -m app serve`` and ``python -m app bench``."""

from app.cli import main

if __name__ == "__main__":
    main()
