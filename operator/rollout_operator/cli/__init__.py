"""`rolloutctl`: one Typer app; each command group lives in its own module and imports heavy code lazily."""
