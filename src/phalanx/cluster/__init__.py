"""phalanx across processes and hosts.

* :mod:`phalanx.cluster.tf_config` -- parse/validate ``TF_CONFIG`` into a :class:`ClusterInfo`;
  build it for local clusters;
* :mod:`phalanx.cluster.launch` -- ``phalanx launch``: a local cluster on loopback;
* :mod:`phalanx.cluster.strategies` -- ``parallel.strategy`` -> tf.distribute strategy
  (imports TensorFlow; import it explicitly);
* :mod:`phalanx.cluster.netns`, :mod:`phalanx.cluster.security` -- keeping the
  unauthenticated gRPC servers off the network.

This package imports no TensorFlow by itself, so ``phalanx launch`` starts at once.
See docs/clusters.md.
"""

from phalanx.cluster.tf_config import ClusterInfo, TFConfigError, cluster_info_from_env, parse_tf_config

__all__ = ["ClusterInfo", "TFConfigError", "cluster_info_from_env", "parse_tf_config"]
