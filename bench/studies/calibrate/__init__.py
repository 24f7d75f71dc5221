"""The cost model fitted to the real CPU engine and the simulator checked against it.

``study`` (``calibrate``): the fit (``steps``) from the config (``config``), checked offline against two
real runs (``validation``), written by ``report``. ``online`` (``calibrate_online``): the calibrated
simulator against the real engine under Poisson arrivals (``online_compare``, ``online_report``).
"""
