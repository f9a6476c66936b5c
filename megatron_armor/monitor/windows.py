"""A bounded window of a metric's recent values, with the statistics the alarms read."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Window:
    """The last `size` values pushed, oldest first; JSON-able (`values`)."""

    size: int
    values: list[float] = field(default_factory=list)

    def push(self, value: float) -> None:
        self.values = [*self.values, float(value)][-self.size :]

    @property
    def full(self) -> bool:
        return len(self.values) >= self.size

    def mean(self) -> float:
        """The mean of the values (0.0 when empty)."""
        return sum(self.values) / len(self.values) if self.values else 0.0

    def slope(self) -> float:
        """Least-squares slope of the values against their position (per push; 0.0 for fewer than two)."""
        n = len(self.values)
        if n < 2:
            return 0.0
        x_mean, y_mean = (n - 1) / 2, self.mean()
        covariance = sum((x - x_mean) * (y - y_mean) for x, y in enumerate(self.values))
        return covariance / sum((x - x_mean) ** 2 for x in range(n))
