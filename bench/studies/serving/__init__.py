"""The serving study (the paper's Fig. 12, 2 and 13): ``study`` runs it from ``config``
(``bench/configs/serving.yaml``), ``precision`` decides the replicates each headline needs, ``report``
and ``plots`` render it.
"""
