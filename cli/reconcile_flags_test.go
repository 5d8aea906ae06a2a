package cli

import (
	"testing"
	"time"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/server"
)

// workerConfig parses worker flags as `keel worker` does, with env set.
func workerConfig(t *testing.T, env map[string]string, args ...string) (server.Config, error) {
	t.Helper()
	for k, v := range env {
		t.Setenv(k, v)
	}
	var w WorkerFlags
	cmd := &cobra.Command{Use: "worker"}
	w.Bind(cmd)
	require.NoError(t, cmd.ParseFlags(args))
	return w.Config()
}

func TestWorkerReconcilerFlagsAndEnv(t *testing.T) {
	cfg, err := workerConfig(t, nil)
	require.NoError(t, err)
	require.Equal(t, outbox.DefaultReconcileInterval, cfg.Reconciler.Interval)
	require.Equal(t, outbox.DefaultGrace, cfg.Reconciler.Grace)

	cfg, err = workerConfig(t, nil, "--reconcile-interval", "3s", "--reconcile-grace", "12s")
	require.NoError(t, err)
	require.Equal(t, 3*time.Second, cfg.Reconciler.Interval)
	require.Equal(t, 12*time.Second, cfg.Reconciler.Grace)

	env := map[string]string{"KEEL_RECONCILE_INTERVAL": "7s", "KEEL_RECONCILE_GRACE": "20s"}
	cfg, err = workerConfig(t, env)
	require.NoError(t, err)
	require.Equal(t, 7*time.Second, cfg.Reconciler.Interval)
	require.Equal(t, 20*time.Second, cfg.Reconciler.Grace)
	cfg, err = workerConfig(t, env, "--reconcile-grace", "15s")
	require.NoError(t, err)
	require.Equal(t, 15*time.Second, cfg.Reconciler.Grace, "a flag wins over the environment")

	_, err = workerConfig(t, map[string]string{"KEEL_RECONCILE_INTERVAL": "soon"})
	require.ErrorContains(t, err, "KEEL_RECONCILE_INTERVAL")
	_, err = workerConfig(t, map[string]string{"KEEL_RECONCILE_INTERVAL": ""}, "--reconcile-grace", "0s")
	require.ErrorContains(t, err, "--reconcile-grace")
}

// worker and relay name the reconciler's settings alike.
func TestRelayAndWorkerShareReconcilerFlags(t *testing.T) {
	root := New(App{Name: "keel"})
	for _, sub := range []string{"worker", "relay"} {
		cmd, _, err := root.Find([]string{sub})
		require.NoError(t, err)
		for _, name := range []string{"reconcile-interval", "reconcile-grace"} {
			f := cmd.Flags().Lookup(name)
			require.NotNil(t, f, "%s --%s", sub, name)
			require.Contains(t, f.Usage, "env KEEL_", "%s --%s", sub, name)
		}
	}
}
