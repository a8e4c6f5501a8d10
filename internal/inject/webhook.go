package inject

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
)

// review is the part of an admission.k8s.io/v1 AdmissionReview the
// injector reads and writes.
type review struct {
	APIVersion string    `json:"apiVersion"`
	Kind       string    `json:"kind"`
	Request    *request  `json:"request,omitempty"`
	Response   *response `json:"response,omitempty"`
}

type request struct {
	UID       string          `json:"uid"`
	Kind      groupKind       `json:"kind"`
	Operation string          `json:"operation"`
	Namespace string          `json:"namespace"`
	Name      string          `json:"name"`
	Object    json.RawMessage `json:"object"`
	DryRun    *bool           `json:"dryRun,omitempty"`
}

type groupKind struct {
	Group, Version, Kind string
}

type response struct {
	UID       string   `json:"uid"`
	Allowed   bool     `json:"allowed"`
	Status    *status  `json:"status,omitempty"`
	PatchType string   `json:"patchType,omitempty"`
	Patch     []byte   `json:"patch,omitempty"` // base64 in JSON, as the API wants
	Warnings  []string `json:"warnings,omitempty"`
}

type status struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
	Reason  string `json:"reason,omitempty"`
}

// maxReview bounds a review's size: the API server sends at most its
// request limit (3 MiB) plus the review's envelope.
const maxReview = 8 << 20

// Handler answers AdmissionReviews of pods: each pod that asks for idem
// gets the patch that adds it; one whose annotations are wrong is refused,
// with a message that names the annotation; every other pod is allowed
// unchanged. A body that is not an AdmissionReview is answered 400.
func (c Config) Handler(log *slog.Logger) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			w.Header().Set("Allow", http.MethodPost)
			http.Error(w, "POST an admission.k8s.io/v1 AdmissionReview", http.StatusMethodNotAllowed)
			return
		}
		body, err := io.ReadAll(io.LimitReader(r.Body, maxReview+1))
		if err != nil || len(body) > maxReview {
			http.Error(w, "cannot read the review (at most 8 MiB)", http.StatusBadRequest)
			return
		}
		var rv review
		if err := json.Unmarshal(body, &rv); err != nil || rv.Request == nil || rv.Kind != "AdmissionReview" {
			http.Error(w, "not an AdmissionReview with a request", http.StatusBadRequest)
			return
		}
		if rv.APIVersion != "admission.k8s.io/v1" {
			http.Error(w, fmt.Sprintf("AdmissionReview %s: only admission.k8s.io/v1 is served", rv.APIVersion), http.StatusBadRequest)
			return
		}
		req := rv.Request
		resp := &response{UID: req.UID, Allowed: true}
		if req.Kind.Kind == "Pod" && req.Kind.Group == "" && req.Operation == "CREATE" {
			ops, err := c.mutateRaw(req.Object)
			switch {
			case err != nil:
				code := http.StatusBadRequest
				if !errors.Is(err, ErrInvalid) {
					code = http.StatusInternalServerError
				}
				resp.Allowed = false
				resp.Status = &status{Code: code, Message: "idem injector: " + err.Error(), Reason: "BadRequest"}
				log.Warn("idem injector: pod refused", "namespace", req.Namespace, "err", err)
			case ops != nil:
				patch, err := json.Marshal(ops)
				if err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				resp.PatchType, resp.Patch = "JSONPatch", patch
				log.Info("idem injector: sidecar added", "namespace", req.Namespace, "name", req.Name, "dry_run", req.DryRun != nil && *req.DryRun)
			}
		}
		out, err := json.Marshal(review{APIVersion: rv.APIVersion, Kind: rv.Kind, Response: resp})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write(out)
	})
}

func (c Config) mutateRaw(raw json.RawMessage) ([]Op, error) {
	d := json.NewDecoder(bytes.NewReader(raw))
	d.UseNumber()
	var pod obj
	if err := d.Decode(&pod); err != nil {
		return nil, fmt.Errorf("%w: the review's object is not a pod: %v", ErrInvalid, err)
	}
	return c.Mutate(pod)
}
