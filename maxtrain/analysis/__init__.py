"""Analysis off the training path: the compiled step as data (`hlo`: collectives, custom calls,
the roofline), `inspect` (what `maxtrain inspect` prints) and `report` (`maxtrain report`). Nothing
on the training path imports this package."""
