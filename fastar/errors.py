"""The one error type the library raises for bad input; its message names the problem."""


class FastARError(ValueError):
    pass
