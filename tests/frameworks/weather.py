"""What every framework script shares: the tool's body (it records each call) and the model to fill. Imported
by the scripts beside it (python puts a script's folder first on its path); needs only pydantic."""

from pydantic import BaseModel

called: list[str] = []


def report(city: str) -> str:
    """The weather in a city."""
    called.append(city)
    return f"Sunny in {city}, 24 degrees Celsius."


class Weather(BaseModel):
    city: str
    celsius: int
