"""``python -m app serve``."""

from app.cli import main

main()
