"""Placeholder until the ahla2 operator lands."""


def ahla2(*args, **kwargs):
    raise NotImplementedError("ahla2 is being written")


def ahla2_step(*args, **kwargs):
    raise NotImplementedError("ahla2_step is being written")
